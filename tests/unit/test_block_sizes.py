"""zero/block_sizes.py: which sizes a config leaves unset are taken from the model's block, and which are kept."""
import pytest
import torch
import torch.nn as nn

from deepspeed_multi.zero import block_sizes


class Tower(nn.Module):
    def __init__(self, width=16, blocks=3):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.Linear(2 * width, width))
                                    for _ in range(blocks))
        self.head = nn.Linear(width, 1000)  # larger than a block: the block is the ModuleList's element


BLOCK = 2 * (16 * 32) + 32 + 16
LIVE = BLOCK  # the block is two pieces (Linears): the prefetch's window is one block


def _fill(stage, optimizer=None, **zero):
    config = {"zero_optimization": {"stage": stage, **zero}}
    filled = block_sizes.fill(config, Tower(), optimizer)
    return config["zero_optimization"], filled


def test_block_is_the_largest_module_list_element_else_the_largest_own_parameters():
    assert block_sizes.block_elements(Tower()) == BLOCK
    assert block_sizes.block_elements(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 100))) == 8 * 100 + 100
    assert block_sizes.block_elements(nn.ReLU()) == 0


def test_zero3_unset_and_auto_sizes_come_from_the_block_written_ones_stay(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    zero, filled = _fill(3, torch.optim.AdamW([nn.Parameter(torch.zeros(1))]), reduce_bucket_size="auto",
                         prefetch_bucket_size=123)
    assert zero["prefetch_bucket_size"] == 123 and "stage3_prefetch_bucket_size" not in filled
    assert filled == {"reduce_bucket_size": BLOCK, "stage3_max_live_parameters": LIVE,
                      "stage3_max_reuse_distance": BLOCK, "sub_group_size": -(-BLOCK // 2)}
    assert zero["reduce_bucket_size"] == BLOCK


def test_zero12_sizes_and_nothing_at_zero0_or_with_the_switch_off(monkeypatch):
    zero, filled = _fill(2, allgather_size=77)  # DeepSpeed's legacy name for allgather_bucket_size
    assert filled == {"reduce_bucket_size": BLOCK} and zero["allgather_size"] == 77
    assert _fill(0)[1] == {}
    monkeypatch.setenv("DSM_BLOCK_SIZES", "0")
    assert _fill(3)[1] == {}


@pytest.mark.parametrize("optimizer, config_type, sized", [
    (torch.optim.SGD, None, True), (torch.optim.Adam, None, True), (torch.optim.Adagrad, None, False),
    (None, "AdamW", True), (None, "Lamb", False), (None, None, False)])
def test_zero3_sub_groups_only_for_element_wise_optimizers(optimizer, config_type, sized):
    config = {"zero_optimization": {"stage": 3}}
    if config_type:
        config["optimizer"] = {"type": config_type, "params": {}}
    opt = optimizer([nn.Parameter(torch.zeros(1))], lr=0.1) if optimizer else None
    assert ("sub_group_size" in block_sizes.fill(config, Tower(), opt)) is sized


def test_never_above_deepspeeds_defaults():
    class Huge(nn.Module):  # a block of two 6e8-element parameters, counted from ds_numel without allocating them
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Module()])
            for name in ("w", "v"):
                p = nn.Parameter(torch.empty(0))
                p.ds_numel = 6 * 10**8
                setattr(self.blocks[0], name, p)

    config = {"zero_optimization": {"stage": 3}}
    filled = block_sizes.fill(config, Huge())
    assert filled["reduce_bucket_size"] == 5 * 10**8 and filled["stage3_prefetch_bucket_size"] == 5 * 10**7
    assert filled["stage3_max_live_parameters"] == 10**9


def test_deepspeeds_defaults_and_names_are_read_from_its_config_model(monkeypatch):
    """Every size is a DeepSpeedZeroConfig field with an integer default (touch_points.tsv): a renamed
    field would silently leave that size to DeepSpeed. A default DeepSpeed lowers is followed."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    fields = DeepSpeedZeroConfig.model_fields
    for name in {*block_sizes._ZERO12, *block_sizes._ZERO3, "sub_group_size"}:
        assert name in fields and isinstance(fields[name].default, int), name
    assert block_sizes._field("prefetch_bucket_size")[:2] == (
        "stage3_prefetch_bucket_size", ("stage3_prefetch_bucket_size", "prefetch_bucket_size"))
    monkeypatch.setattr(fields["reduce_bucket_size"], "default", 100)
    zero, filled = _fill(3)
    assert filled["reduce_bucket_size"] == 100 and filled["stage3_max_reuse_distance"] == BLOCK


MODEL = 4 * 16 + 16 + 3 * BLOCK + 16 * 1000 + 1000  # Tower's elements


@pytest.mark.parametrize("floor", [1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK, MODEL - 1, MODEL, 1 << 22])
def test_blocks_below_the_floor_are_grouped_whole(floor):
    """A size is as many whole blocks as fit in the floor, at least one: never a block and a part; a
    model no larger than the floor has the floor (one bucket, gathered whole)."""
    assert block_sizes.elements(Tower()) == MODEL
    config = {"zero_optimization": {"stage": 3}}
    filled = block_sizes.fill(config, Tower(), None, min_block=floor)
    whole = max(1, floor // BLOCK)
    assert whole * BLOCK <= max(floor, BLOCK) < (whole + 1) * BLOCK
    one = floor if MODEL <= floor else whole * BLOCK  # a model under the floor: one bucket
    assert filled == {"reduce_bucket_size": one, "stage3_prefetch_bucket_size": one,
                      "stage3_max_live_parameters": max(LIVE, one), "stage3_max_reuse_distance": one}


@pytest.mark.parametrize("floor", [BLOCK // 3, BLOCK, BLOCK + 1, 3 * BLOCK // 2, 2 * BLOCK, 5 * BLOCK])
def test_live_parameters_are_one_own_block_never_below_the_grouped_size(floor):
    """DeepSpeed's prefetch slides by module, so one block of live parameters already gathers the next
    block's pieces as the running block releases its own: the live parameters are one of the model's
    own blocks, or the grouped size where that is larger (the prefetch bucket and the reuse distance)."""
    filled = block_sizes.fill({"zero_optimization": {"stage": 3}}, Tower(), None, min_block=floor)
    one = BLOCK * max(1, floor // BLOCK)  # the Tower is larger than each floor here
    assert MODEL > floor and filled["stage3_prefetch_bucket_size"] == filled["stage3_max_reuse_distance"] == one
    assert filled["stage3_max_live_parameters"] == max(LIVE, one) >= one
    assert block_sizes.block_pieces(Tower()) == 2


def test_a_block_of_one_piece_gets_an_element_more_so_the_next_is_prefetched_beside_it():
    """A block that is one module is released all at once: with exactly its size as the window nothing of
    the next block would be gathered before it is needed. A model without a ModuleList has one piece."""
    one_piece = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    assert block_sizes.block_pieces(one_piece) == 1 and block_sizes.block_pieces(nn.Linear(4, 4)) == 1
    assert block_sizes.block_pieces(nn.ReLU()) == 0
    filled = block_sizes.fill({"zero_optimization": {"stage": 3}}, one_piece, None, min_block=0)
    assert filled["stage3_max_live_parameters"] == 8 * 8 + 8 + 1 and filled["stage3_prefetch_bucket_size"] == 8 * 8 + 8


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("floor", [0, 30, 80, 1 << 12])
def test_sizes_are_even_for_an_odd_block(stage, floor):
    """ZeRO-1/2 asserts that its all-gather bucket is a multiple of 2 elements: an odd size is
    rounded up by one. ZeRO-3's live parameters are not a bucket and are not rounded (see the test above)."""
    model = nn.Sequential(nn.Linear(5, 5), nn.ModuleList(nn.Linear(5, 5, bias=False) for _ in range(4)))
    assert block_sizes.block_elements(model) == 25 and block_sizes.elements(model) == 130
    filled = block_sizes.fill({"zero_optimization": {"stage": stage}}, model, None, min_block=floor)
    live = filled.pop("stage3_max_live_parameters", None)
    grouped = floor if floor >= 130 else 25 * max(1, floor // 25)
    assert set(filled.values()) <= {grouped + grouped % 2} and all(v % 2 == 0 for v in filled.values()), filled
    assert live == (max(25 + 1, grouped) if stage == 3 else None)  # one piece: one block and an element


def test_the_floor_option_is_checked():
    from deepspeed_multi.config import MultiOptions
    assert MultiOptions.from_config({}).min_block_elements == 1 << 22
    with pytest.raises(ValueError, match="min_block_elements must be an integer >= 0"):
        MultiOptions.from_config({"deepspeed_multi": {"min_block_elements": -1}})
