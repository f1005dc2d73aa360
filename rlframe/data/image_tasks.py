"""Built-in image tasks, drawn offline with PIL and written in verl's vision-language layout.

verl's `examples/data_preprocess/geo3k.py` writes a row as `prompt` (chat messages whose text holds one `<image>`
placeholder per image), `images` (a list of `{"bytes": PNG bytes, "path": ...}`), `data_source`,
`reward_model.ground_truth` and `extra_info`; these tasks write exactly that, so the dataset, the rollout and
the reward treat them as they treat geo3k.

`colour_vl`: a 56 x 56 picture split into a large and a small area of two of four colours; "Which colour covers
the most? 1 red 2 green 3 blue 4 yellow. Answer with the number." -> the digit of the larger area's colour.
Answers are uniform over 1..4, and which colour is large is independent of where it is.

`count_vl`: one to four white squares on black at random places of an 84 x 84 picture; "How many squares?
Answer with the number." -> that number, uniform over 1..4.

Both are scored as `add_digits` is (1 for exactly the answer, 0.5 for starting with it; `rlframe.reward.scorers`).
"""

from __future__ import annotations

import random

from rlframe.models.tiny_vl import COLOUR_PROMPT, COUNT_PROMPT
from rlframe.models.vision import png_bytes

COLOURS = {1: (220, 40, 40), 2: (40, 200, 60), 3: (50, 80, 230), 4: (240, 220, 40)}


def _row(name: str, prompt: str, image, answer: int, split: str, index: int, extra: dict) -> dict:
    return {
        "data_source": name,
        "prompt": [{"role": "user", "content": prompt}],
        "images": [{"bytes": png_bytes(image), "path": None}],
        "ability": "vision",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, **extra},
    }


def colour_vl_rows(split: str, num_samples: int, seed: int) -> list[dict]:
    """Rows of `colour_vl`: the larger of two coloured areas names the answer."""
    from PIL import Image, ImageDraw

    rng = random.Random(f"colour_vl/{split}/{seed}")
    rows = []
    for index in range(num_samples):
        large, small = rng.sample(sorted(COLOURS), 2)
        cut = rng.randint(14, 20)  # the small area's width in pixels, of 56
        image = Image.new("RGB", (56, 56), COLOURS[large])
        left = rng.random() < 0.5  # the small area on the left or the right
        box = (0, 0, cut, 56) if left else (56 - cut, 0, 56, 56)
        ImageDraw.Draw(image).rectangle((box[0], box[1], box[2] - 1, box[3] - 1), fill=COLOURS[small])
        rows.append(_row("colour_vl", COLOUR_PROMPT, image, large, split, index, {"small": small, "cut": cut}))
    return rows


def count_vl_rows(split: str, num_samples: int, seed: int) -> list[dict]:
    """Rows of `count_vl`: 1 to 4 white 14 x 14 squares on black, never touching, at random cells of a 6 x 6 grid."""
    from PIL import Image, ImageDraw

    rng = random.Random(f"count_vl/{split}/{seed}")
    cells = [(x, y) for x in range(0, 6, 2) for y in range(0, 6, 2)]  # 9 cells two apart: squares never touch
    rows = []
    for index in range(num_samples):
        count = rng.randint(1, 4)
        image = Image.new("RGB", (84, 84), (0, 0, 0))
        draw = ImageDraw.Draw(image)
        for x, y in rng.sample(cells, count):
            draw.rectangle((x * 14, y * 14, x * 14 + 13, y * 14 + 13), fill=(255, 255, 255))
        rows.append(_row("count_vl", COUNT_PROMPT, image, count, split, index, {}))
    return rows
