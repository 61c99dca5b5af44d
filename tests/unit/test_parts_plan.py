"""deepspeed_multi.parts: which part owns what, each part's config, and what is refused (no processes)."""
import pytest
import torch
import torch.nn as nn

from deepspeed_multi.parts import optimizer as parts_optimizer
from deepspeed_multi.parts.plan import REST, Plan, declared_submodules


class Tower(nn.Module):

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.scale = nn.Parameter(torch.ones(4))


class Model(nn.Module):

    def __init__(self):
        super().__init__()
        self.vision = Tower()
        self.projector = nn.Linear(4, 4)
        self.llm = Tower()
        self.act = nn.GELU()  # no parameters: nothing for the rest to hold


def _config(**submodules):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 1}, "fp16": {"enabled": True},
            "deepspeed_multi": {"submodules": submodules, "watchdog_timeout_s": 60}}


def _plan(model, **submodules):
    config = _config(**submodules)
    declared = declared_submodules(config)
    return Plan(model, config, declared), config


def test_parts_own_every_parameter_once_and_the_rest_takes_what_is_left():
    model = Model()
    plan, config = _plan(model, llm={"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}},
                         **{"vision.blocks": {"zero_optimization": {"stage": 2}}})
    assert "submodules" not in config["deepspeed_multi"] and config["deepspeed_multi"]["watchdog_timeout_s"] == 60
    assert list(plan.modules) == ["llm", "vision.blocks", REST]
    assert plan.modules["llm"] is model.llm and plan.modules["vision.blocks"] is model.vision.blocks
    rest = {id(p) for p in plan.modules[REST].parameters()}
    want = {id(p) for p in [*model.vision.embed.parameters(), model.vision.scale, *model.projector.parameters()]}
    assert rest == want
    assert plan.stages() == {"llm": 3, "vision.blocks": 2, REST: 1}
    # The part's own precision replaces the model's; the rest of the top level is inherited.
    assert "fp16" not in plan.configs["llm"] and plan.configs["llm"]["bf16"] == {"enabled": True}
    assert plan.configs["vision.blocks"]["fp16"] == {"enabled": True}
    assert plan.configs["llm"]["gradient_accumulation_steps"] == 2
    owner = plan.owner_of()
    assert owner[id(model.llm.scale)] == "llm" and owner[id(model.projector.weight)] == REST


def test_no_rest_when_the_declarations_cover_the_model():
    model = Model()
    plan, _ = _plan(model, vision={}, projector={}, llm={})
    assert list(plan.modules) == ["vision", "projector", "llm"]


@pytest.mark.parametrize("submodules, words", [
    ({"vison": {}}, ["no submodule 'vison'", "['vision', 'projector', 'llm', 'act']"]),
    ({"vision": {}, "vision.blocks": {}}, ["'vision' and 'vision.blocks'", "one inside the other"]),
    ({"llm": {"optimizer": {"type": "Adam"}}}, ["sets 'optimizer'", "one optimizer serves every part"]),
    ({"llm": {"scheduler": {}}}, ["sets 'scheduler'"]),
    ({"llm": {"gradient_accumulation_steps": 4}}, ["gradient_accumulation_steps=4", "has gradient_accumulation_steps=2"]),
    ({"llm": {"gradient_clipping": 0.5}}, ["gradient_clipping=0.5"]),
    ({"llm": {"fp16": {"enabled": True}, "bf16": {"enabled": True}}}, ["both fp16 and bf16"]),
    ({"llm": {"deepspeed_multi": {"submodules": {"x": {}}}}}, ["declares submodules of its own"]),
    ({"llm": 3}, ["must be a dict of DeepSpeed settings"]),
])
def test_refused_with_the_submodule_named(submodules, words):
    with pytest.raises(ValueError) as info:
        _plan(Model(), **submodules)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_a_part_may_repeat_a_whole_model_setting():
    plan, _ = _plan(Model(), llm={"gradient_accumulation_steps": 2, "gradient_clipping": 1.0})
    assert plan.configs["llm"]["gradient_accumulation_steps"] == 2


def test_a_weight_tied_across_parts_is_refused():
    model = Model()
    model.llm.embed.weight = model.vision.embed.weight
    with pytest.raises(ValueError, match=r"vision.embed.weight = llm.embed.weight belongs to two parts, 'llm' and '_rest'"):
        _plan(model, llm={})


def test_empty_declarations_are_refused():
    with pytest.raises(ValueError, match="must map submodule names"):
        declared_submodules({"deepspeed_multi": {"submodules": {}}})
    assert declared_submodules({"deepspeed_multi": {"skip_group": "x"}}) is None


def test_the_client_optimizer_is_split_by_part_keeping_its_groups():
    model = Model()
    plan, _ = _plan(model, llm={})
    decay = [p for p in model.parameters() if p.ndim == 2]
    no_decay = [p for p in model.parameters() if p.ndim == 1]
    client = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                               lr=3e-3, betas=(0.8, 0.9))
    split = parts_optimizer.split(client, plan.owner_of(), list(plan.modules))
    llm_opt, llm_sources = split["llm"]
    assert type(llm_opt) is torch.optim.AdamW and llm_sources == [0, 1]
    assert {id(p) for p in llm_opt.param_groups[0]["params"]} == {id(p) for p in decay if p in
                                                                  set(model.llm.parameters())}
    assert llm_opt.param_groups[0]["weight_decay"] == 0.1 and llm_opt.param_groups[1]["weight_decay"] == 0.0
    assert llm_opt.param_groups[0]["betas"] == (0.8, 0.9)
    client.param_groups[1]["lr"] = 1e-4  # a scheduler (or the user) changes the client's groups
    parts_optimizer.sync_hyperparameters(client, llm_opt, llm_sources)
    assert llm_opt.param_groups[1]["lr"] == 1e-4 and llm_opt.param_groups[0]["lr"] == 3e-3


def test_a_part_the_optimizer_leaves_out_gets_none():
    model = Model()
    plan, _ = _plan(model, llm={})
    split = parts_optimizer.split(torch.optim.SGD(model.llm.parameters(), lr=0.1), plan.owner_of(), list(plan.modules))
    assert split[REST] == (None, []) and split["llm"][1] == [0]


def test_an_optimizer_with_state_or_foreign_parameters_is_refused():
    model = Model()
    plan, _ = _plan(model, llm={})
    used = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    used.step()
    with pytest.raises(ValueError, match="has state already"):
        parts_optimizer.split(used, plan.owner_of(), list(plan.modules))
    foreign = torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=0.1)
    with pytest.raises(ValueError, match=r"param group 0 .* \(shape \(3,\)\) .* not a parameter of the model"):
        parts_optimizer.split(foreign, plan.owner_of(), list(plan.modules))
