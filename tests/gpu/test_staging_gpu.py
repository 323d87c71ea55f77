"""The page table `Staging.gather` builds on the GPU: the driver-launched kernel (`tactix.cudadrv`)
gives every row its own pages, from the caller's device indices or from the slot, in any thread."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from tactix import staging as staging_module
from tactix.staging import Staging, csr_table, sections

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _kernel_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging_module, "_table_kernel_on", True)  # (whatever TACTIX_PAGE_TABLE_KERNEL says)


def _batch(rows: int, real: int, seed: int) -> tuple[list[int], list[int], torch.Tensor]:
    """``real`` requests' page counts (some of one page, one of many), their CSR starts padded to
    ``rows`` (rows past the batch start at nnz, as the plugins lay them out), and the indices."""
    rng = random.Random(seed)
    pages = [rng.choice([1, 2, rng.randint(3, 300)]) for _ in range(real)]
    starts = [0]
    for p in pages:
        starts.append(starts[-1] + p)
    nnz = starts[-1]
    indices = torch.randperm(nnz + 50, generator=torch.Generator().manual_seed(seed))[:nnz].to(torch.int32)
    return pages, starts[:-1] + [nnz] * (rows - real), indices


def _gathered(rows: int, real: int, seed: int, from_device: bool, indices_form: str = "int32") -> None:
    device = torch.device("cuda")
    pages, row_starts, indices = _batch(rows, real, seed)
    nnz, width = int(indices.numel()), max(pages) + 3
    layout = sections(("row_starts", rows), ("pages", nnz + width))
    staging = Staging(device, layout.total, rows * width)
    slot = staging.slot(False)
    host = indices if not from_device else torch.empty(0, dtype=torch.int32)
    staging.send(slot, layout.total, lambda dst: layout.write(dst, [row_starts, host]))
    # poison the table buffer: every entry the gather owns must be written
    staging._tables[slot].fill_(-7)
    source = None
    if from_device:
        source = indices.to(device)
        if indices_form == "int64":
            source = source.long()
        elif indices_form == "strided":
            source = torch.stack([source, source], 1)[:, 0]
    staging.gather(slot, layout.offset("pages"), rows, width, layout.offset("row_starts"), nnz, source)
    got = staging.gathered(slot, rows, width).cpu()
    want = csr_table(indices, row_starts, nnz, width)  # the kernel's rule, computed on the host
    for r, p in enumerate(pages):
        assert torch.equal(got[r, :p], want[r, :p]), f"row {r}: its pages"
    if staging_module._CSR_TO_TABLE.launcher(staging.index) is not None:
        # the kernel writes page 0 past each row's pages and in rows past the batch
        assert torch.equal(got, want)


def test_the_kernel_loads_on_this_gpu() -> None:
    assert staging_module._CSR_TO_TABLE.launcher(torch.cuda.current_device()) is not None


@pytest.mark.parametrize("from_device", [True, False], ids=["device indices", "indices sent with the metadata"])
@pytest.mark.parametrize(("rows", "real"), [(1, 1), (8, 8), (64, 61), (300, 300)])
def test_every_row_gets_its_own_pages(rows: int, real: int, from_device: bool) -> None:
    _gathered(rows, real, seed=rows + real, from_device=from_device)


@pytest.mark.parametrize("form", ["int64", "strided"])
def test_device_indices_the_kernel_cannot_read_in_place_are_copied_first(form: str) -> None:
    _gathered(16, 16, seed=3, from_device=True, indices_form=form)


def test_a_thread_that_never_touched_the_gpu_gathers_the_same_table() -> None:
    errors: list[BaseException] = []

    def work() -> None:
        try:
            _gathered(32, 30, seed=5, from_device=True)
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors, errors[0]


def test_the_gather_is_ordered_after_the_slot_transfer_on_a_side_stream() -> None:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for seed in range(5):
            _gathered(64, 64, seed=seed, from_device=seed % 2 == 0)


def test_threads_gathering_at_once_each_get_their_own_table() -> None:
    """One launcher per device serves every thread: concurrent plans must not mix their arguments."""
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for round_ in range(10):
                _gathered(48, 40 + seed, seed=100 * seed + round_, from_device=round_ % 2 == 0)
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
