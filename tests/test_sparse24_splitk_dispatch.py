"""CPU: the shipped 2:4 dispatch table and margin (python/ferroattn/sparse24/dispatch.py) choose the sparse kernel on the
medium LLM shapes where GPU time measured it faster than dense and cuSPARSELt
(bench/results/sparse24_splitk_20261130T1105/call1_split_*.json), and dense where it is slower; the entries
whose native schedule is the 128-row wgmma_sp tile:
bench/results/sparse24_schedules_20261130T1333/call2_sweep_20261130T1341.json."""
import pytest

from ferroattn import sparse24


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("rows,n,k,want", [
    (256, 11008, 4096, "sparse"),      # 1.07-1.08x dense (1.1 margin kept dense: 0.96x cuSPARSELt)
    (512, 11008, 4096, "sparse"),
    (256, 4096, 11008, "sparse"),      # split-k: 1.04-1.13x dense
    (512, 4096, 11008, "sparse"),
    (300, 14336, 4096, "sparse"),
    (256, 4096, 4096, "sparse"),       # 128-row tile: 1.16-1.19x dense (split-k was 0.85x)
    (512, 4096, 4096, "sparse"),       # 1.31-1.34x (whole 256-row tiles were 0.86-0.87x)
    (128, 11008, 4096, "sparse"),      # 1.29x (split-k was 0.95-0.97x)
    (128, 4096, 4096, "dense"),        # still split-k (16 tiles): 0.74x
    (1024, 1024, 1024, "dense"),       # 128-row tile 0.94-0.95x: still dense
    (16, 11008, 4096, "sparse"),       # mma_sp decode
])
def test_shipped_table_decisions(dtype, rows, n, k, want):
    sparse24.dispatch._DECISIONS.clear()
    assert sparse24.dispatch._decide("sm_90", dtype, n, k, rows) == want


def test_margin_between_parity_and_old_margin():
    assert 1.0 < sparse24.SPARSE_MIN_SPEEDUP < 1.1
    # every shipped entry is a positive finite speedup
    for shapes in sparse24.DISPATCH_TABLE["sm_90"].values():
        for pts in shapes.values():
            assert all(r >= 1 and 0.1 < s < 5 for r, s in pts)


def test_row_entries_meet_the_native_kernel_switch():
    """Rows >= 46 (native WGMMA_MIN_ROWS: wgmma_sp) are nearest to a >= 64-row entry (wgmma_sp-measured), rows
    <= 45 (mma_sp) to a <= 32-row one, so each decision rests on the kernel that runs."""
    import math
    for rows, want in [(45, 32), (46, 64)]:
        pts = [16, 32, 64, 96, 128]
        assert min(pts, key=lambda r: (abs(math.log(r) - math.log(rows)), r)) == want
