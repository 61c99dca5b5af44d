"""Rank functions for test_misuse.py: each mistake meets a clear error naming the engine and the
fix, and leaves the engines' gradients exactly as they would be without it."""
import deepspeed
import deepspeed.comm as dist
import torch

import deepspeed_multi
from common import MLP, ds_config, full_params
from common import expect_error as _expect


class Enc(MLP):
    pass


class Dec(MLP):
    pass


def _pair(stage):
    out = []
    for cls, seed in ((Enc, 1), (Dec, 2)):
        model = cls(seed=seed)
        out.append(deepspeed_multi.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                              config=ds_config(stage))[0])
    return out


def _batch():
    g = torch.Generator().manual_seed(dist.get_rank())
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _same(engines, others, what):
    for e, o in zip(engines, others):
        got, want = full_params(e), full_params(o)
        for n in want:
            assert torch.equal(got[n], want[n]), f"{what}: {e._engine_name()}.{n} differs from the clean run"


def _clean_step(stage):
    """The same iteration without any misuse: what the engines must end up with."""
    enc, dec = _pair(stage)
    x, y = _batch()
    ((dec(enc(x)) - y)**2).mean().backward()
    enc.step()
    dec.step()
    return enc, dec


def step_and_zero_grad_inside_backward(stage):
    enc, dec = _pair(stage)
    x, y = _batch()
    seen = []

    def hook(grad):  # runs in Dec's backward: Dec is producing its gradients, Enc has yet to be reached
        for call in (dec.step, enc.step, enc.zero_grad, dec.zero_grad):
            try:
                call()
            except RuntimeError as e:
                seen.append(str(e))
        return grad

    handle = dec.module.fc1.weight.register_hook(hook) if stage != 3 else dec.module.fc1.register_full_backward_hook(
        lambda m, gi, go: hook(None))
    ((dec(enc(x)) - y)**2).mean().backward()
    handle.remove()
    assert len(seen) == 4, seen
    assert "MultiEngine (Dec): step() called while a backward pass is still producing" in seen[0], seen[0]
    assert "MultiEngine (Enc): step() called inside a backward pass that has yet to reach this engine" in seen[1], seen[1]
    assert "MultiEngine (Enc): zero_grad() called inside a backward pass that has yet to reach" in seen[2], seen[2]
    assert "MultiEngine (Dec): zero_grad() called while a backward pass" in seen[3], seen[3]
    assert all("after loss.backward() returns" in s for s in seen), seen
    enc.step()
    dec.step()
    _same((enc, dec), _clean_step(stage), f"stage {stage} after refused step/zero_grad in a hook")


def engine_backward_twice_on_one_loss(stage):
    enc, dec = _pair(stage)
    x, y = _batch()
    loss = ((dec(enc(x)) - y)**2).mean()
    enc.backward(loss, retain_graph=True)
    _expect(RuntimeError, lambda: dec.backward(loss), "MultiEngine (Dec).backward(loss): this loss was already "
            "backpropagated by MultiEngine (Enc).backward(loss)", "twice", "Call backward once per loss")
    enc.step()
    dec.step()
    _same((enc, dec), _clean_step(stage), f"stage {stage} after a refused second backward")


def engine_given_to_initialize_again(stage):
    enc, _ = _pair(stage)
    opt = torch.optim.SGD(enc.parameters(), lr=0.1)
    _expect(TypeError, lambda: deepspeed_multi.initialize(model=enc, optimizer=opt, config=ds_config(stage)),
            "deepspeed_multi.initialize: model is already a MultiEngine (for Enc)", "engine.module")
    outer = deepspeed.initialize(model=enc, optimizer=opt, config=ds_config(stage))[0]  # upstream builds it
    x, _ = _batch()
    _expect(TypeError, lambda: outer(x), "MultiEngine (Enc) is the model of another engine (DeepSpeedEngine)",
            "engine.module")


def requires_grad_changed_after_initialize(stage):
    x, y = _batch()
    for name, flip in (("fc1.weight", False), ("fc2.bias", True)):
        model = Enc(seed=1)
        if flip:
            dict(model.named_parameters())[name].requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        enc = deepspeed_multi.initialize(model=model, optimizer=torch.optim.SGD(params, lr=0.1),
                                         config=ds_config(stage))[0]
        before = full_params(enc)
        dict(enc.module.named_parameters())[name].requires_grad_(flip)
        ((enc(x) - y)**2).mean().backward()
        if not flip and stage in (1, 2, 3):
            enc.step()  # allowed there: [Note: requires_grad turned off after initialize]
            assert torch.equal(before[name], full_params(enc)[name]), "plain SGD, zero gradient: must not move"
            continue
        _expect(RuntimeError, enc.step, f"MultiEngine (Enc): requires_grad changed after deepspeed_multi.initialize "
                f"on {name!r} ({'False -> True' if flip else 'True -> False'})", "Set requires_grad before initialize")
        after = full_params(enc)
        assert all(torch.equal(before[n], after[n]) for n in before), "a refused update must not move anything"


def zero3_output_used_after_a_later_forward(stage):
    """ZeRO-3 re-partitions after each forward; an output of an earlier forward is still exact."""
    enc, _ = _pair(stage)
    ref = Enc(seed=1)
    x, y = _batch()
    first = enc(x)
    enc(2 * x)  # a later forward gathers and releases the parameters again
    ((first - y)**2).mean().backward()
    enc.step()
    world = dist.get_world_size()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for r in range(world):
        g = torch.Generator().manual_seed(r)
        xr, yr = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
        (((ref(xr) - yr)**2).mean() / world).backward()
    opt.step()
    got = full_params(enc)
    for n, p in ref.named_parameters():
        assert (got[n] - p.detach()).abs().max().item() <= 1e-5, n


def all_misuse(stages):
    for stage in stages:
        step_and_zero_grad_inside_backward(stage)
        engine_backward_twice_on_one_loss(stage)
        engine_given_to_initialize_again(stage)
        requires_grad_changed_after_initialize(stage)
        zero3_output_used_after_a_later_forward(stage)


# --------------------------------------------------------------- engines on different data-parallel groups
class TinyMpu:
    """The least an ``mpu`` needs for deepspeed.initialize: ``model_parallel`` lists the
    model-parallel groups (they partition the ranks); the data-parallel groups are the ranks at
    the same position in each. Every rank creates every group, in the same order."""

    def __init__(self, model_parallel):
        rank = dist.get_rank()
        for ranks in model_parallel:
            group = torch.distributed.new_group(ranks)
            if rank in ranks:
                self.mp_group, self.mp_ranks = group, list(ranks)
        for i in range(len(model_parallel[0])):
            ranks = [mp[i] for mp in model_parallel]
            group = torch.distributed.new_group(ranks)
            if rank in ranks:
                self.dp_group, self.dp_ranks = group, ranks

    def get_model_parallel_rank(self):
        return self.mp_ranks.index(dist.get_rank())

    def get_model_parallel_world_size(self):
        return len(self.mp_ranks)

    def get_model_parallel_group(self):
        return self.mp_group

    def get_data_parallel_rank(self):
        return self.dp_ranks.index(dist.get_rank())

    def get_data_parallel_world_size(self):
        return len(self.dp_ranks)

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_group_ranks(self):
        return list(self.dp_ranks)


def _mpu_pair(stage, mpus, allow=(False, False), gas=1):
    """Enc and Dec with ``mpus[i]`` (None: no mpu). Enc is built first: DeepSpeed keeps the last
    mpu given to initialize in a process-wide global (deepspeed.utils.groups.mpu), which an engine
    built later without an mpu would take as its own; _reset_mpu() clears it after each case."""
    out = []
    for (cls, seed), mpu, ok in zip(((Enc, 1), (Dec, 2)), mpus, allow):
        model = cls(seed=seed)
        cfg = ds_config(stage, gas=gas, deepspeed_multi={"allow_mixed_dp_groups": ok})
        out.append(deepspeed_multi.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                              config=cfg, mpu=mpu)[0])
    return out


def _reset_mpu():
    from deepspeed.utils import groups
    groups.mpu = None


def _data(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _reference_chain(batches_per_step, gas):
    """Plain PyTorch Dec(Enc(x)): each micro-step averages the losses of its batches; an update per window."""
    enc, dec = Enc(seed=1), Dec(seed=2)
    opt = torch.optim.SGD(list(enc.parameters()) + list(dec.parameters()), lr=0.1)
    for step, batches in enumerate(batches_per_step):
        for x, y in batches:
            (((dec(enc(x)) - y)**2).mean() / (len(batches) * gas)).backward()
        if (step + 1) % gas == 0:
            opt.step()
            opt.zero_grad()
    return enc, dec


def _assert_close(engine, module, what):
    got = full_params(engine)
    for n, p in module.named_parameters():
        err = (got[n] - p.detach()).abs().max().item()
        assert err <= 1e-5, f"{what}: {engine._engine_name()}.{n} off by {err:.3e} from plain PyTorch (want <= 1e-5)"


def mixed_dp_groups_refused(stage):
    """Enc on the world (no mpu), Dec with an mpu whose model-parallel group is both ranks (its
    data-parallel group is the rank alone): one backward through both is refused on every rank,
    before either engine's backward starts; afterwards each engine trains exactly under its own loss."""
    rank = dist.get_rank()
    for allow in ((False, False), (True, False)):
        enc, dec = _mpu_pair(stage, (None, TinyMpu([[0, 1]])), allow=allow)
        x, y = _data(0, rank)
        msg = _expect(RuntimeError, lambda: ((dec(enc(x)) - y)**2).mean().backward(),
                      "one backward pass reaches engines on different data-parallel groups",
                      f"MultiEngine (Enc) averages its gradients over ranks [0, 1], MultiEngine (Dec) over ranks "
                      f"[{rank}]", "Give every engine of one loss the same mpu",
                      '{"deepspeed_multi": {"allow_mixed_dp_groups": true}}',
                      "not set on: Dec)" if allow[0] else "not set on: Enc, Dec)")
        for e in (enc, dec):
            assert e._state.name == "IDLE", f"stage {stage}: {e._engine_name()} left {e._state} by the refusal: {msg}"
            assert "backward" not in getattr(e.watchdog, "marks", {}), f"{e._engine_name()}: watchdog mark left"
        _reset_mpu()
    # Still usable, and a loss per engine is fine without the opt-in: Enc averages over both
    # ranks, Dec (data-parallel group of one) keeps its rank's gradient.
    ((enc(x) - y)**2).mean().backward()
    ((dec(x) - y)**2).mean().backward()
    enc.step()
    dec.step()
    ref_enc, ref_dec = Enc(seed=1), Dec(seed=2)
    for r in range(dist.get_world_size()):
        xr, yr = _data(0, r)
        (((ref_enc(xr) - yr)**2).mean() / dist.get_world_size()).backward()
    ((ref_dec(x) - y)**2).mean().backward()
    for m in (ref_enc, ref_dec):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    _assert_close(enc, ref_enc, f"stage {stage}, a loss per engine after the refusal")
    _assert_close(dec, ref_dec, f"stage {stage}, a loss per engine after the refusal")
    _expect(RuntimeError, lambda: ((dec(enc(x)) - y)**2).mean().backward(), "different data-parallel groups")


def mixed_dp_groups_allowed(stage, gas):
    """With the opt-in and the same batch on both ranks, both engines match plain PyTorch on that batch."""
    enc, dec = _mpu_pair(stage, (None, TinyMpu([[0, 1]])), allow=(True, True), gas=gas)
    steps = 2 * gas
    for step in range(steps):
        x, y = _data(step, 0)  # replicated: every rank holds rank 0's batch
        ((dec(enc(x)) - y)**2).mean().backward()
        enc.step()
        dec.step()
    ref_enc, ref_dec = _reference_chain([[_data(s, 0)] for s in range(steps)], gas)
    _assert_close(enc, ref_enc, f"stage {stage}, gas {gas}, opted-in mixed groups")
    _assert_close(dec, ref_dec, f"stage {stage}, gas {gas}, opted-in mixed groups")
    _reset_mpu()


def same_dp_group_needs_no_opt_in(stage):
    """The same mpu on both engines (each rank its own data-parallel group), and an mpu whose
    data-parallel group is the world beside an engine without one (other group objects, the same
    ranks): no opt-in, exact."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mpu = TinyMpu([[0, 1]])
    for mpus, dp_ranks in (((mpu, mpu), [rank]), ((None, TinyMpu([[r] for r in range(world)])), list(range(world)))):
        enc, dec = _mpu_pair(stage, mpus)
        x, y = _data(0, rank)
        ((dec(enc(x)) - y)**2).mean().backward()
        enc.step()
        dec.step()
        ref_enc, ref_dec = _reference_chain([[_data(0, r) for r in dp_ranks]], 1)
        _assert_close(enc, ref_enc, f"stage {stage}, data-parallel group {dp_ranks} on both")
        _assert_close(dec, ref_dec, f"stage {stage}, data-parallel group {dp_ranks} on both")
        _reset_mpu()


def all_dp_groups(stages):
    for stage in stages:
        mixed_dp_groups_refused(stage)
        for gas in (1, 2):
            mixed_dp_groups_allowed(stage, gas)
        same_dp_group_needs_no_opt_in(stage)
