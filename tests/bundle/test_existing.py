"""What convert does at its output, decided as a pure function over plain findings (marlin_pack.bundle.existing.decide)."""

from __future__ import annotations

import pytest

from marlin_pack.bundle.existing import Findings, State, decide
from marlin_pack.errors import OutputExistsError

CHANGED = "tp2/rank-1.safetensors changed since it was written"


def bundle(**kw: object) -> Findings:
    return Findings(State.bundle, **{"held": (1, 2), "held_format": 4, **kw})  # type: ignore[arg-type]


def test_nothing_there_or_an_empty_directory_gets_every_size_asked() -> None:
    new = decide(Findings(State.missing), [2, 1, 2])
    assert (new.write, new.keep, new.common, new.summary) == ((1, 2), (), True, "tp1, tp2 (a new bundle)")
    empty = decide(Findings(State.empty), [1])
    assert empty.write == (1,) and empty.common and empty.summary == "tp1 into the empty directory"
    assert decide(Findings(State.empty, machete=frozenset({1})), [1]).format_version == 5


@pytest.mark.parametrize("force", [False, True])
def test_what_is_not_a_bundle_is_refused_even_with_force(force: bool) -> None:
    with pytest.raises(OutputExistsError, match=r"^/o exists and is not a marlin-pack bundle$"):
        decide(Findings(State.other, "/o exists and is not a marlin-pack bundle"), [1], force)


def test_an_intact_bundle_of_these_settings_is_up_to_date_whatever_sizes_beside() -> None:
    for asked in ([1], [2], [1, 2]):
        same = decide(bundle(), asked)
        assert same.up_to_date and same.keep == (1, 2) and same.summary == "up to date"
    # A size not asked is not checked: its damage is no reason to write (verify tells); nor an older format's.
    assert decide(bundle(sets={2: CHANGED}), [1]).up_to_date
    assert decide(bundle(held_format=3), [1, 2]).up_to_date


def test_a_size_more_is_added_and_the_others_kept() -> None:
    more = decide(bundle(), [4])
    assert (more.write, more.keep, more.drop, more.common) == ((4,), (1, 2), (), False)
    assert more.summary == "added tp4; tp1, tp2 kept" and more.why == "tp4 is not in it"


def test_a_damaged_size_is_rewritten_alone() -> None:
    healed = decide(bundle(sets={2: CHANGED}), [1, 2])
    assert (healed.write, healed.keep, healed.common) == ((2,), (1,), False)
    assert healed.summary == f"rewrote tp2: {CHANGED}; tp1 kept"
    common = decide(bundle(common="is missing"), [2])
    assert (common.write, common.keep, common.common) == ((), (1, 2), True)
    assert common.summary == "rewrote common.safetensors: it is missing; tp1, tp2 kept" and not common.whole


def test_sizes_in_another_layout_are_rewritten_if_asked_and_dropped_if_not() -> None:
    why = "its layers are in marlin's layout, asked for machete"
    # Asked in Machete's layout (format 5) beside Marlin files (format 4): nothing can be kept.
    layout = decide(bundle(sets={1: why, 2: why}, machete=frozenset({1, 2})), [1])
    assert (layout.write, layout.drop, layout.common, layout.format_version) == ((1,), (2,), True, 5)
    assert layout.summary == (f"rewrote tp1 and common.safetensors: {why} (format 5; the bundle's other files are format 4: "
                              "none kept); dropped tp2 (not asked)")
    # In the same format (a layer shape another marlin-pack planned otherwise): the others stay.
    shapes = decide(bundle(sets={2: "its layers have other shapes than this checkpoint implies"}), [2])
    assert (shapes.write, shapes.keep, shapes.drop) == ((2,), (1,), ())


def test_a_bundle_of_another_checkpoint_dtype_or_older_format_is_rewritten_whole() -> None:
    why = "source file model.safetensors changed since the bundle was made"
    stale = decide(bundle(whole=why), [2, 4])
    assert (stale.write, stale.keep, stale.drop, stale.common) == ((2, 4), (), (1,), True) and stale.whole
    assert stale.summary == f"rewrote tp2, tp4 and common.safetensors: {why}; dropped tp1 (not asked)"
    older = decide(Findings(State.bundle, "it was made by an older marlin-pack (format_version 1)",
                            whole="it was made by an older marlin-pack (format_version 1)", held_format=1), [1])
    assert older.write == (1,) and older.common and older.summary.endswith("(format_version 1)")


def test_a_newer_bundle_needs_force_and_force_rewrites_everything() -> None:
    newer = Findings(State.bundle, "/o holds a bundle this marlin-pack cannot use (format_version 9: a newer marlin-pack's)",
                     newer=True, whole="x", held_format=9)
    with pytest.raises(OutputExistsError, match=r"cannot use \(format_version 9: a newer marlin-pack's\); pass `force=True` to replace it"):
        decide(newer, [1])
    assert decide(newer, [1], force=True).write == (1,)
    forced = decide(bundle(), [2], force=True)
    assert (forced.write, forced.keep, forced.drop, forced.common) == ((2,), (), (1,), True)
    assert forced.summary == "rewrote tp2 and common.safetensors: `force=True`; dropped tp1 (not asked)"


def test_target_kernel_names_the_kernels_the_layers_are_laid_out_for() -> None:
    from marlin_pack.schemas import TARGET_KERNELS, LayerKernel, target_kernel

    assert target_kernel([]) == target_kernel([LayerKernel.marlin] * 3) == "MarlinLinearKernel"
    assert target_kernel([LayerKernel.machete]) == "MacheteLinearKernel"
    assert target_kernel([LayerKernel.marlin, LayerKernel.machete]) == "MacheteLinearKernel+MarlinLinearKernel"
    assert set(TARGET_KERNELS) == {target_kernel(k) for k in ([LayerKernel.marlin], [LayerKernel.machete], list(LayerKernel))}
