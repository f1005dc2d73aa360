"""The FSDP workers' config sections, one file per role; `model.py` holds what several roles share."""
