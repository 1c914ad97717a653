"""nnU-Net's augmentations on the devices: layout-independent, exact where drawn off,
against SciPy's resampling and blur, and bounded reads of the store."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, prepare_store, tiny_config
from scipy import ndimage

from ctseg.data.grids import AIR_HU, hu_to_unit
from ctseg.data.store import Store
from ctseg.errors import CtsegError
from ctseg.parallel import xla_options
from ctseg.parallel.partition import make_mesh
from ctseg.synth.dataset import write_dataset
from ctseg.training import augment, draws, pipeline, warp

BASE = [*TINY, "model.depth=3", "train.rotate90=true", "train.batch_size=2", "mesh.data=2"]
EVERY = [
    "augment.rotation_p=1",
    "augment.scaling_p=1",
    "augment.noise_p=0.5",
    "augment.blur_p=0.5",
    "augment.brightness_p=0.5",
    "augment.contrast_p=0.5",
    "augment.low_resolution_p=0.5",
    "augment.gamma_p=0.5",
    "augment.gamma_inverted_p=0.5",
    "augment.phase_p=0.5",
]
# Intensity scale and shift off, so that a spatial transform alone can be compared.
PLAIN = ["train.intensity_scale=0", "train.intensity_shift=0", "train.rotate90=false"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("augment")
    write_dataset(root / "raw", cases=4, size=32, seed=3)
    prepare_store(root / "raw", root / "prep", tiny_config(*BASE))
    return Store.open(root / "prep")


def batch(store, config, spatial=(1, 1, 1), data=1, step=5):
    return jax.device_get(pipeline.training_batch(store, config, make_mesh(spatial, data), step))


def test_partitioned_batch_equals_unpartitioned(store):
    config = tiny_config(*BASE, *EVERY)
    whole = batch(store, config)
    for spatial, data in (((2, 1, 1), 2), ((4, 2, 2), 1)):  # 4 and 16 devices
        image, label = batch(store, config, spatial, data)
        np.testing.assert_allclose(image, whole[0], rtol=0, atol=1e-6)
        np.testing.assert_array_equal(label, whole[1])
    assert set(np.unique(whole[1])) <= {0, 1, 2}
    assert np.isfinite(whole[0]).all()


def test_drawn_off_transforms_leave_the_batch_as_without_them(store):
    """Probabilities too small ever to draw: the devices' batch is the host's (warped by a
    flip-and-quarter-turn matrix, or not warped at all), to the float32 rounding of the
    window's scaling (the devices may fuse its multiply and add; the host does not)."""
    today = batch(store, tiny_config(*BASE))
    for never in (["augment.rotation_p=1e-12"], ["augment.noise_p=1e-12", "augment.gamma_p=1e-12"]):
        config = tiny_config(*BASE, *never)
        assert config.augment.on_device
        image, label = batch(store, config, (2, 2, 1), 2)
        np.testing.assert_allclose(image, today[0], rtol=0, atol=2.5e-7)
        np.testing.assert_array_equal(label, today[1])


def test_warp_equals_scipy_affine_transform(store):
    config = tiny_config(*BASE, *PLAIN, "augment.rotation_p=1", "augment.scaling_p=1")
    picks = pipeline.cases_for_step([c.id for c in store.split("train")], 0, 5, 2)
    image, label = batch(store, config, (2, 2, 1), 2)
    box = store.resolution
    centre = np.full(3, (box - 1) / 2)
    for b, case in enumerate(picks):
        base = draws.draw_augmentation(config, 5, b)
        matrix = draws.draw_sample(config, 5, b, base).matrix
        offset = np.asarray(store.case(case).box_offset)
        shift = centre - matrix @ centre + offset
        unit = hu_to_unit(np.asarray(store.image(case)), config.data.hu_window).astype(np.float64)
        want = ndimage.affine_transform(
            unit, matrix, shift, (box,) * 3, order=1, mode="grid-constant", cval=-1.0
        )
        np.testing.assert_allclose(image[b, ..., 0], want, atol=1e-5)
        nearest = ndimage.affine_transform(
            np.asarray(store.label(case)), matrix, shift, (box,) * 3, order=0, mode="grid-constant"
        )
        assert np.mean(label[b] == nearest) > 0.999  # SciPy and we may round ties apart
        assert not np.array_equal(label[b], np.asarray(store.box(case, "label")))


def test_blur_equals_scipy_gaussian_filter(store):
    config = tiny_config(*BASE, *PLAIN, "augment.blur_p=1", "augment.blur_sigma=[0.5,1.0]")
    today = batch(store, tiny_config(*BASE, *PLAIN))
    image, _ = batch(store, config, (2, 2, 1), 2)
    for b in range(2):
        params = draws.draw_sample(config, 5, b, draws.Augmentation()).params
        want = today[0][b, ..., 0].astype(np.float64) + 1  # beyond the box is air, −1
        for axis, name in enumerate("xyz"):
            want = ndimage.gaussian_filter1d(
                want, params[f"blur_sigma_{name}"], axis=axis, mode="constant", radius=3
            )
        np.testing.assert_allclose(image[b, ..., 0], want - 1, atol=1e-5)


def test_intensity_transforms_keep_what_they_promise(store):
    today = batch(store, tiny_config(*BASE, *PLAIN))[0][..., 0]
    contrast = batch(store, tiny_config(*BASE, *PLAIN, "augment.contrast_p=1"), (2, 2, 1), 2)
    gamma = batch(store, tiny_config(*BASE, *PLAIN, "augment.gamma_p=1"), (2, 2, 1), 2)
    for b in range(2):
        # Contrast: clipped to the box's own range; gamma: the box's mean and spread kept.
        assert today[b].min() <= contrast[0][b].min() <= contrast[0][b].max() <= today[b].max()
        assert gamma[0][b].mean() == pytest.approx(today[b].mean(), abs=1e-4)
        assert gamma[0][b].std() == pytest.approx(today[b].std(), rel=1e-3)
        assert not np.allclose(gamma[0][b], today[b])


def test_a_contrast_phase_moves_the_liver_to_its_drawn_mean_and_nothing_but_its_tumours(store):
    config = tiny_config(*BASE, *PLAIN, "augment.phase_p=1")
    today = batch(store, tiny_config(*BASE, *PLAIN))
    image, label = batch(store, config, (2, 2, 1), 2)
    np.testing.assert_array_equal(label, today[1])
    for b in range(2):
        params = draws.draw_sample(config, 5, b, draws.Augmentation()).params
        before, after, labels = today[0][b, ..., 0], image[b, ..., 0], today[1][b]
        liver, tumour = labels == 1, labels == 2
        assert liver.any() and tumour.any()
        # The shift that takes the liver's mean to the drawn one (the window clips it).
        shift = params["phase_liver"] - before[liver].mean()
        assert abs(shift) > 0.01  # a phase that moved the liver, not one at its own HU
        np.testing.assert_allclose(after[liver], np.clip(before[liver] + shift, -1, 1), atol=1e-5)
        want = np.clip(before[tumour] + shift * params["phase_tumour_share"], -1, 1)
        np.testing.assert_allclose(after[tumour], want, atol=1e-5)
        # The rest as it was, to the rounding of the window's scaling (as above).
        np.testing.assert_allclose(after[labels == 0], before[labels == 0], rtol=0, atol=2.5e-7)


@pytest.mark.parametrize("axes", ["xyz", "z"])
def test_preimage_holds_every_voxel_the_warp_reads(axes):
    """The devices' own source points (float32) floor inside the host's preimage, which
    fits the static block: were the box a voxel smaller, some draw would read outside."""
    config = tiny_config(
        "data.resolution=48",
        "train.rotate90=true",
        "augment.rotation_p=1",
        "augment.scaling_p=1",
        f"augment.rotation_axes={axes!r}".replace("'", '"'),
    )
    box, slab = 48, (12, 12, 48)
    extent = warp.preimage_extent(config.augment, True, slab)
    tightest = np.full(3, 99)
    for sample, cell in itertools.product(range(40), itertools.product(range(4), range(4))):
        draw = draws.draw_sample(config, 1, sample, draws.draw_augmentation(config, 1, sample))
        start = [cell[0] * 12, cell[1] * 12, 0]
        low, high = warp.preimage(draw.matrix, box, start, slab)
        assert np.all(high - low <= extent)
        q = warp.source_grid(
            jnp.asarray(draw.matrix[None], jnp.float32), (box - 1) / 2, start, slab
        )
        reads_low = np.array([int(jnp.floor(c).min()) for c in q])
        reads_high = np.array([int(jnp.floor(c).max()) + 1 for c in q])
        assert np.all(reads_low >= low) and np.all(reads_high < high)
        tightest = np.minimum(tightest, np.minimum(reads_low - low, high - 1 - reads_high))
    assert np.all(tightest <= 1)  # the slack is one voxel: a smaller box would miss


def test_a_halo_wider_than_a_partition_is_refused(store):
    config = tiny_config(*BASE, "augment.blur_p=1", "augment.blur_sigma=[1.0,2.0]")
    with pytest.raises(CtsegError, match="mesh.spatial"):
        augment.Augmenter(config, make_mesh((4, 2, 1), 1), store.resolution)


def test_out_of_range_settings_are_refused():
    for bad, key in (
        ("augment.noise_p=1.5", "augment.noise_p"),
        ("augment.scaling=[1.4,0.7]", "augment.scaling"),
        ("augment.rotation_degrees=120", "augment.rotation_degrees"),
        ("augment.low_resolution=[0.5,2]", "augment.low_resolution"),
    ):
        with pytest.raises(CtsegError, match=key):
            tiny_config(bad)


def test_fill_beyond_the_grid_is_air(store):
    """A box zoomed out reads beyond the grid: air there, background labels."""
    config = tiny_config(*BASE, *PLAIN, "augment.scaling_p=1", "augment.scaling=[0.5,0.5]")
    image, label = batch(store, config)
    assert AIR_HU < config.data.hu_window[0]
    assert np.all(image[:, 0] == -1.0) and np.all(label[:, 0] == 0)


def test_blocks_bounded_by_the_grid_give_the_batch_of_unbounded_ones(store):
    """A warped sample's block is its preimage clipped to a voxel of fill around the grid:
    the batch is the one read from blocks bounded by the warps alone."""
    config = tiny_config(*BASE, *EVERY)
    mesh = make_mesh((2, 1, 1), 2)
    bounded = pipeline.augmenter_for(store, config, mesh)
    unbounded = augment.Augmenter(config, mesh, store.resolution)
    assert all(b < u for b, u in zip(bounded.block, unbounded.block, strict=True))
    for step in (3, 5):
        made = [
            jax.device_get(pipeline.training_batch(store, config, mesh, step, a))
            for a in (bounded, unbounded)
        ]
        np.testing.assert_array_equal(made[0][0], made[1][0])
        np.testing.assert_array_equal(made[0][1], made[1][1])


def test_the_program_compiles_when_the_augmenter_is_made_and_never_during_a_run(store):
    """Two programs per run (batches read as slabs, batches with a warped sample read as
    blocks), compiled before the first batch: 200 steps of warped and unwarped samples of
    every transform compile nothing more."""
    from ctseg.parallel.compile_cache import compile_clock

    config = tiny_config(*BASE, *EVERY, "augment.rotation_p=0.3", "augment.scaling_p=0.3")
    clock = compile_clock()
    before = clock.by_name["jit(program)"]
    prefetch = pipeline.Prefetcher(store, config, make_mesh((2, 1, 1), 2), 0, 200)
    made = clock.by_name["jit(program)"]
    try:
        assert sum(1 for _ in prefetch) == 200
    finally:
        prefetch.close()
    assert made == before + 2
    assert clock.by_name["jit(program)"] == made


def _compiled_ops(config) -> tuple[int, int]:
    """(instructions, slices) of the compiled augmentation at 32³."""
    augmenter = augment.Augmenter(config, make_mesh((1, 1, 1), 1), 32, (32, 32, 32))
    lines = [line for line in augmenter.compiled.as_text().splitlines() if " = " in line]
    return len(lines), sum(" slice(" in line for line in lines)


def test_the_program_is_bounded_and_its_loops_rolled_whatever_the_kernel(monkeypatch):
    """The blur's taps and the box sums' passes are rolled loops (unrolled, a GPU
    compiler spent minutes on their slices of the whole block): a kernel three times
    wider adds no instruction, and the module holds 171 slices where the unrolled sums
    made 569. The whole stays within a bound set from this design (3,864 instructions
    on XLA:CPU for every transform at 32³). Each program compiles without the tuning of
    its fusions (on an H100 the warped blocks' program took 40 s with it)."""
    untuned = []

    def compile_untuned(lowered):
        untuned.append(lowered)
        return xla_options.compile_untuned(lowered)

    monkeypatch.setattr(augment, "compile_untuned", compile_untuned)
    every = [*BASE, "train.batch_size=1", "mesh.data=1", *EVERY]
    narrow = _compiled_ops(tiny_config(*every, "augment.blur_sigma=[0.5,1.0]"))
    wide = _compiled_ops(tiny_config(*every, "augment.blur_sigma=[0.5,3.0]"))
    assert narrow == wide
    instructions, slices = narrow
    assert instructions < 4500 and slices < 250
    assert len(untuned) == 4  # slabs and blocks, twice
