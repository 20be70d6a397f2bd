"""What the localiser's divergence record carries: where, by how much, and the row an offline
recomputation needs (the differing elements and the input tap's row)."""

import torch

from megatron_rz.tools.localise import DIFF_ELEMENTS, first_divergence


def _taps(seed):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(5, 4, generator=g).to(torch.bfloat16),
            "y": torch.randn(5, 2, 3, generator=g).to(torch.bfloat16),
            "z": torch.randn(5, 6, generator=g).to(torch.bfloat16)}


def test_equal_sides_compare_every_tap():
    ref = _taps(0)
    side = {k: v.clone() for k, v in ref.items()}
    assert first_divergence(ref, side, ["x", "y", "z"]) == {"first_diverging_tap": None, "taps_compared": 3}


def test_one_ulp_in_a_three_dimensional_tap_names_its_row_elements_and_input_row():
    ref = _taps(1)
    side = {k: v.clone() for k, v in ref.items()}
    y = side["y"].view(torch.int16)
    y[3, 1, 2] += 1  # one bf16 ulp at position 3, flat column 5
    y[4, 0, 0] += 1
    d = first_divergence(ref, side, ["x", "y", "z"])
    assert d["first_diverging_tap"] == "y" and d["first_position"] == 3 and d["positions_differing"] == 2
    assert d["taps_equal_before"] == 1 and d["dtype"] == "bfloat16"
    [[col, r, s]] = d["differing_elements"]
    assert col == 5 and r == float(ref["y"][3, 1, 2]) and s == float(side["y"][3, 1, 2]) and r != s
    assert d["input_tap"] == "x" and d["input_row"] == ref["x"][3].double().tolist()
    assert d["max_abs_diff"] == max(abs(float(ref["y"][p, i, j]) - float(side["y"][p, i, j]))
                                    for p, i, j in ((3, 1, 2), (4, 0, 0)))


def test_the_first_tap_has_no_input_row_and_the_element_list_is_capped():
    ref = _taps(2)
    side = {k: v.clone() for k, v in ref.items()}
    side["x"][0] += 1.0  # every element of row 0
    side["z"] = torch.zeros(5, 6, dtype=torch.bfloat16)
    ref["x"] = torch.cat([ref["x"]] * 4, dim=1)  # 16 columns
    side["x"] = torch.cat([side["x"]] * 4, dim=1)
    d = first_divergence(ref, side, ["x", "y", "z"])
    assert d["first_diverging_tap"] == "x" and "input_tap" not in d
    assert len(d["differing_elements"]) == DIFF_ELEMENTS


def test_taps_missing_on_one_side_are_skipped_not_compared():
    ref = _taps(3)
    side = {k: v.clone() for k, v in ref.items() if k != "y"}
    side["z"][2, 1] += 1.0
    d = first_divergence(ref, side, ["x", "y", "z"])
    assert d["first_diverging_tap"] == "z" and d["taps_equal_before"] == 1 and d["input_tap"] == "x"
