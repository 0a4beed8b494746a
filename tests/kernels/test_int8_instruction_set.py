"""Which build of the int8 kernels a CPU gets: the instruction set whose vector lanes are the packed layouts'
TILE and whose features the CPU lists, or none (the float matvecs run)."""

import pytest

from bubo.kernels import int8_matvec

VNNI = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"}
AVX2 = {"avx2", "fma", "f16c"}


@pytest.mark.parametrize(
    ("tile", "flags", "expected"),
    [
        (16, VNNI, "AVX512-VNNI"),
        (8, AVX2, "AVX2"),
        (8, VNNI, "AVX2"),  # 8-lane layouts (inductor picked AVX2): the AVX2 build fits them
        (16, AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}, None),  # AVX-512 without VNNI
        (8, {"avx2"}, None),  # no FMA or F16C
        (4, set(), None),
    ],
)
def test_the_build_fits_the_tiles_and_the_cpu(
    monkeypatch: pytest.MonkeyPatch, tile: int, flags: set[str], expected: str | None
) -> None:
    monkeypatch.setattr(int8_matvec, "TILE", tile)
    monkeypatch.setattr(int8_matvec, "_cpu_flags", lambda: flags)
    int8_matvec._instruction_set.cache_clear()
    try:
        isa = int8_matvec._instruction_set()
        assert (isa.name if isa else None) == expected
    finally:
        int8_matvec._instruction_set.cache_clear()
