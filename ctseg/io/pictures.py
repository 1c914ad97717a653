"""Pictures: training curves and prediction previews (matplotlib, no screen needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy import ndimage

from ctseg import atomic
from ctseg.labels import LIVER, TUMOUR, liver_mask


def _pyplot() -> Any:
    """matplotlib's pyplot, drawing to files, imported with the first picture rather than
    with the pipelines (its import takes a noticeable part of a second:
    docs/experiments/design-figures.md#pictures): a prediction draws on its writer's
    thread, off the way to its first scan, and training at its first validation, after its
    first step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(entries: Sequence[dict[str, Any]], path: Path) -> None:
    """Loss over steps (left) and validation Dice of liver and tumour (right)."""
    plt = _pyplot()
    fig, (ax_loss, ax_dice) = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
    steps = [e["step"] for e in entries]
    ax_loss.plot(steps, [e["loss"] for e in entries], color="tab:blue")
    ax_loss.set(xlabel="step", ylabel="training loss", yscale="log", title="Loss")
    val = [e for e in entries if "val_dice_liver" in e]
    for key, label, colour in (
        ("val_dice_liver", "liver", "tab:red"),
        ("val_dice_tumour", "tumour", "tab:green"),
    ):
        ax_dice.plot(
            [e["step"] for e in val], [e[key] for e in val], "o-", label=label, color=colour
        )
    ax_dice.set(xlabel="step", ylabel="Dice", ylim=(0, 1), title="Validation Dice (grid)")
    ax_dice.legend(loc="lower right")
    for ax in (ax_loss, ax_dice):
        ax.grid(alpha=0.3)
    with atomic.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


# Overlay colours of liver and tumour (RGBA); background stays transparent.
_OVERLAY = {LIVER: (0.95, 0.35, 0.2, 0.45), TUMOUR: (0.1, 0.9, 0.2, 0.7)}


# The preview's centre is found on every 4th voxel along each axis: 64× fewer voxels, far
# faster on a large scan, and the same slices to within 2 voxels
# (docs/experiments/design-figures.md#pictures).
_CENTRE_STEP = 4


def preview_centre(labels: np.ndarray) -> tuple[int, int, int]:
    """The voxel the preview's three slices go through: the liver's centre, else the volume's."""
    step = _CENTRE_STEP
    liver = liver_mask(labels[::step, ::step, ::step])
    if not liver.any():
        liver = liver_mask(labels)  # a liver smaller than the sampling grid
        step = 1
    if not liver.any():
        return tuple(n // 2 for n in labels.shape)
    centre = (round(c * step) for c in ndimage.center_of_mass(liver))
    return tuple(min(int(c), n - 1) for c, n in zip(centre, labels.shape, strict=True))


def _drawable(text: str) -> str:
    """`text` with each character the default font has no glyph for (CJK, emoji) written
    as its escape, \\u809d: matplotlib would draw a box and warn for each."""
    from matplotlib import font_manager

    font = font_manager.get_font(font_manager.findfont(font_manager.FontProperties()))
    drawable = font.get_charmap()
    return "".join(c if ord(c) in drawable else ascii(c)[1:-1] for c in text)


def plot_preview(
    hu: np.ndarray,
    labels: np.ndarray,
    spacing: Sequence[float],
    path: Path,
    title: str = "",
    window: Sequence[float] = (-200.0, 250.0),
) -> None:
    """Axial, coronal and sagittal slices through the liver with a coloured label overlay.

    `hu` and `labels` are canonical (RAS) arrays of one shape; `spacing` their
    voxel size in mm, which sets each panel's aspect ratio.
    """
    plt = _pyplot()
    cx, cy, cz = preview_centre(labels)
    sx, sy, sz = (float(s) for s in spacing)
    # (image slice, label slice, row spacing, column spacing, name); rows are drawn
    # bottom-up (origin="lower"), so anterior and superior point up.
    panels = (
        (hu[:, :, cz].T, labels[:, :, cz].T, sy, sx, f"axial z={cz}"),
        (hu[:, cy, :].T, labels[:, cy, :].T, sz, sx, f"coronal y={cy}"),
        (hu[cx, :, :].T, labels[cx, :, :].T, sz, sy, f"sagittal x={cx}"),
    )
    fig, axes = plt.subplots(1, 3, figsize=(12, 4.4), constrained_layout=True)
    for ax, (image, label, row_mm, col_mm, name) in zip(axes, panels, strict=True):
        ax.imshow(
            image,
            cmap="gray",
            vmin=window[0],
            vmax=window[1],
            origin="lower",
            aspect=row_mm / col_mm,
            interpolation="nearest",
        )
        overlay = np.zeros((*label.shape, 4), np.float32)
        for value, colour in _OVERLAY.items():
            overlay[label == value] = colour
        ax.imshow(overlay, origin="lower", aspect=row_mm / col_mm, interpolation="nearest")
        ax.set_title(name)
        ax.set_axis_off()
    if title:
        # A file name is shown as it is: "$" starts no formula ("a$^^{$b" would not parse).
        fig.suptitle(_drawable(title), parse_math=False)
    with atomic.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
