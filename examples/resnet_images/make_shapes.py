"""Write a small image folder to try the example on: ``python make_shapes.py DIR``.

Classes ``circle``, ``square``, ``triangle``, ``cross``: one shape per image in a
random colour, size and place, on a random dark background, with pixel noise.
"""

import argparse
import importlib.util
import os
import random
import sys

CLASSES = ("circle", "square", "triangle", "cross")


def draw(kind: str, size: int, rng: random.Random):
    from PIL import Image, ImageDraw

    background = tuple(rng.randrange(0, 90) for _ in range(3))
    image = Image.new("RGB", (size, size), background)
    pen = ImageDraw.Draw(image)
    colour = tuple(rng.randrange(120, 256) for _ in range(3))
    r = rng.uniform(0.2, 0.4) * size
    cx, cy = rng.uniform(r, size - r), rng.uniform(r, size - r)
    if kind == "circle":
        pen.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif kind == "square":
        pen.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif kind == "triangle":
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    else:
        w = r / 3
        pen.rectangle((cx - r, cy - w, cx + r, cy + w), fill=colour)
        pen.rectangle((cx - w, cy - r, cx + w, cy + r), fill=colour)
    noise = bytes(min(255, max(0, v + rng.randrange(-20, 21))) for v in image.tobytes())
    return Image.frombytes("RGB", (size, size), noise)


def make_shapes(root: str, per_class: int = 200, size: int = 32, seed: int = 0) -> None:
    rng = random.Random(seed)
    for kind in CLASSES:
        os.makedirs(os.path.join(root, kind), exist_ok=True)
        for i in range(per_class):
            draw(kind, size, rng).save(os.path.join(root, kind, f"{i:04d}.png"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("--per-class", type=int, default=200)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if importlib.util.find_spec("PIL") is None:
        sys.exit("make_shapes.py needs Pillow: pip install pillow (or the examples extra: pip install -e '.[examples]')")
    make_shapes(args.root, args.per_class, args.size, args.seed)
    print(f"{args.per_class * len(CLASSES)} images in {args.root}/{{{','.join(CLASSES)}}}")
