"""Rank functions for test_watchdog.py (importable by the spawned ranks)."""
import time

import deepspeed.comm as dist
import torch

import deepspeed_multi
from common import MLP, ds_config


class Actor(MLP):
    pass


class Critic(MLP):
    pass


def _engine(cls, stage, timeout_s, seed, agree=None, **model_kw):
    model = cls(seed=seed, **model_kw)
    cfg = ds_config(stage, deepspeed_multi={"watchdog_timeout_s": timeout_s, "agree_before_collectives": agree})
    return deepspeed_multi.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=cfg)[0]


def _train(actor, critic, steps):
    """``steps`` steps of Actor -> Critic under one loss; the last batch."""
    for step in range(steps):
        x, y = _batch(step)
        ((critic(actor(x)) - y)**2).mean().backward()
        actor.step()
        critic.step()
    return x, y


def _batch(step):
    g = torch.Generator().manual_seed(10 * step + dist.get_rank())
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def one_rank_skips_critic(stage, timeout_s, failed_backward_first, skip="update", steps=8):
    """Actor -> Critic train together on every rank, then rank 0 alone runs a Critic-only update
    (a PPO value epoch that rank 1 skips: its batch had no value targets) while rank 1 goes on
    with rank-local work. Rank 0 then waits in Critic's first collective: its forward at ZeRO-3,
    its backward's reduction at ZeRO-2, its step()'s rank-agreement all-reduce at ZeRO-0/1. The
    watchdog must end both ranks; the test reads the message from the logs.

    ``skip="step"``: every rank runs Critic's backward and rank 1 skips only its step(): rank 0
    then waits in the update's collectives.

    ``steps``: the training steps before the divergence; by 8 the group's recent regions predict
    the next one (reliability/region_sequence.py), so the rank that stays on the loop's path skips
    its meeting and the rank that leaves it meets.

    ``failed_backward_first``: a backward through both engines raises in a user hook (caught,
    as a training loop that skips bad batches would) and every rank idles longer than the
    timeout before the divergence: the stale "backward" mark must not fire.
    """
    actor, critic = _engine(Actor, stage, timeout_s, 1), _engine(Critic, stage, timeout_s, 2)
    x, y = _train(actor, critic, steps)
    if failed_backward_first:
        handle = critic.module.fc2.weight.register_hook(_raise)
        try:
            ((critic(actor(x)) - y)**2).mean().backward()
        except ValueError:
            pass
        handle.remove()
        time.sleep(timeout_s + 2)
        print(f"IDLE_DONE {time.time()}", flush=True)
        actor.zero_grad()
        critic.zero_grad()
    if skip == "step":  # every rank runs the backward; rank 1 then skips Critic's step()
        ((critic(x) - y)**2).mean().backward()
    print(f"DIVERGE {time.time()}", flush=True)
    if dist.get_rank() == 0:
        if skip == "update":
            ((critic(x) - y)**2).mean().backward()
        critic.step()
    time.sleep(10 * timeout_s + 60)  # rank-local work, no collective
    raise AssertionError("the watchdog should have ended this rank")


def one_rank_skips_into_another_engine(stage, timeout_s, agree=None, steps=2):
    """Rank 0 runs a Critic-only update then an Actor-only one; rank 1 skips the Critic's and runs
    the Actor's. Their collectives pair Critic's with Actor's, whose sizes differ (Critic is
    wider): gloo aborts the process on the size mismatch unless the ranks meet at the store first
    (agree_before_collectives), where the watchdog names each rank's engine. After 2 ``steps`` both
    ranks meet at the divergence; after 8 the loop's recent regions predict Actor's forward, so rank
    1 skips its meeting and waits in Actor's first collective while rank 0 waits at its meeting.
    """
    actor = _engine(Actor, stage, timeout_s, 1, agree)
    critic = _engine(Critic, stage, timeout_s, 2, agree, d_hidden=40)
    x, y = _train(actor, critic, steps)
    print(f"DIVERGE {time.time()}", flush=True)
    if dist.get_rank() == 0:
        ((critic(x) - y)**2).mean().backward()
        critic.step()
    ((actor(x) - y)**2).mean().backward()
    actor.step()
    time.sleep(10 * timeout_s + 60)  # rank-local work, no collective
    raise AssertionError("the watchdog should have ended this rank")


def one_rank_runs_a_collective_of_its_own(stage, timeout_s, steps=8):
    """Actor -> Critic train for ``steps`` steps (their regions are then predicted and the meetings
    skipped); then rank 0 alone all-reduces a metric through deepspeed.comm, outside both engines,
    while rank 1 goes on to the next step. Where the group predicts the next region (ZeRO-3: after 8
    steps), rank 0's collective is not what it predicts, so rank 0 meets first and waits while rank 1
    waits in that region's first collective; where nothing is predicted yet (ZeRO-1's two updates a
    step fill the window only then), rank 0's collective runs and waits while rank 1 meets at its
    update. Without either meeting the metric's all-reduce would pair with an engine's collective
    (gloo aborts on the sizes)."""
    actor, critic = _engine(Actor, stage, timeout_s, 1), _engine(Critic, stage, timeout_s, 2)
    x, y = _train(actor, critic, steps)
    print(f"DIVERGE {time.time()}", flush=True)
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(3))
    x, y = _batch(steps)
    ((critic(actor(x)) - y)**2).mean().backward()
    actor.step()
    critic.step()
    time.sleep(10 * timeout_s + 60)
    raise AssertionError("the watchdog should have ended this rank")


def _raise(grad):
    raise ValueError("user hook failed")


def rank_dependent_calls(timeout_s, then):
    """A generation loop of one's own over a frozen ZeRO-3 engine (no Transformers generate): rank 0 calls it
    twice, rank 1 five times (sequences that end at different lengths), then every rank ``then``: "exit" (the
    program ends) or "train" (a ZeRO-2 engine's update, whose collectives rank 1 never reaches). Rank 1 waits
    in the ZeRO-3 engine's parameter gather; the watchdog must end every rank within seconds, long before
    ``timeout_s``, naming where rank 0 went ([Note: a rank that left the others' path])."""
    model = Critic(seed=2)
    cfg = ds_config(3, deepspeed_multi={"watchdog_timeout_s": timeout_s})
    teacher = deepspeed_multi.initialize(model=model.requires_grad_(False), config=cfg)[0]
    student = _engine(Actor, 2, timeout_s, 1)
    x, y = _train(student, student, 2)
    print(f"DIVERGE {time.time()}", flush=True)
    with torch.no_grad():
        for _ in range(2 if dist.get_rank() == 0 else 5):
            x = teacher(x)
    if then == "train":
        ((student(x) - y)**2).mean().backward()
        student.step()
        time.sleep(timeout_s + 60)
        raise AssertionError("the watchdog should have ended this rank")
    print(f"DONE {time.time()}", flush=True)
