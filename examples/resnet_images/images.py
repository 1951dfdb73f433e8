"""An image folder as ``(train_set, val_set)``: ``root/<class>/<image>`` (class names
sorted give the labels 0, 1, ...), every image as RGB ``size`` x ``size``, scaled
to [-1, 1]; a seeded ``val_fraction`` of the images is held out.

torchvision's ``ImageFolder`` reads the folder where torchvision imports; a plain
Pillow loader with the same class order does otherwise (pip install pillow).
Images are decoded once, up front: the example's folders are small."""

import os

import torch
from torch.utils.data import Subset, TensorDataset

from ddpx.errors import DdpxError  # printed as one line naming the problem

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".webp")


def _samples(root: str) -> list[tuple[str, int]]:
    classes = sorted(d.name for d in os.scandir(root) if d.is_dir())
    try:
        from torchvision.datasets import ImageFolder
    except Exception:  # not installed, or a build that does not match this torch
        return [(os.path.join(root, c, name), label) for label, c in enumerate(classes)
                for name in sorted(os.listdir(os.path.join(root, c))) if name.lower().endswith(EXTENSIONS)]
    return ImageFolder(root).samples


def image_folder(root: str = None, size: int = 32, val_fraction: float = 0.2, seed: int = 0):
    if not root or not os.path.isdir(root):
        raise DdpxError(f"images.image_folder: data.args.root {root!r} is not a folder; point it at "
                         f"root/<class>/<image> (e.g. made by make_shapes.py)")
    try:
        from PIL import Image
    except ImportError:
        raise DdpxError("images.image_folder needs Pillow without torchvision: pip install pillow") from None
    samples = _samples(root)
    if not samples:
        raise DdpxError(f"images.image_folder: no images under {root}/<class>/")
    pixels = torch.empty(len(samples), 3, size, size)
    for i, (path, _) in enumerate(samples):
        with Image.open(path) as image:
            image = image.convert("RGB").resize((size, size))
            data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        pixels[i] = data.view(size, size, 3).permute(2, 0, 1).float() / 127.5 - 1
    labels = torch.tensor([label for _, label in samples])
    data = TensorDataset(pixels, labels)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed)).tolist()
    cut = int(len(order) * (1 - val_fraction))
    return Subset(data, order[:cut]), Subset(data, order[cut:])
