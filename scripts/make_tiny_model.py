"""Write a tiny random-init Qwen2-style model and tokenizer: python scripts/make_tiny_model.py OUT_DIR."""

from rlframe.utils.tiny_model import main

if __name__ == "__main__":
    main()
