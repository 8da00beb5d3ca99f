"""Horovod Elastic on dtrain (``hvd.elastic``): the sampler's re-split, and a Horovod-style
script that survives a killed worker with every sample of each epoch trained on once and the
same weights as a run without the kill."""

from __future__ import annotations

import torch


def _pretend_world(monkeypatch, rank: int, size: int) -> None:
    from dtrain.compat.horovod import _basics

    monkeypatch.setattr(_basics, "is_initialized", lambda: True)
    monkeypatch.setattr(_basics, "rank", lambda: rank)
    monkeypatch.setattr(_basics, "size", lambda: size)


def test_elastic_sampler_resplits_what_is_left_once(monkeypatch):
    from dtrain.compat.horovod.elastic import ElasticSampler

    data, batch = list(range(60)), 3
    seen: list[int] = []
    samplers = []
    for r in range(2):  # 2 ranks: 4 steps of 3 samples each
        _pretend_world(monkeypatch, r, 2)
        samplers.append(ElasticSampler(data, seed=5))
        seen += list(samplers[r])[: 4 * batch]
    for s in samplers:
        for step in range(4):
            s.record_batch(step, batch)
    state = samplers[0].state_dict()
    assert state == {"epoch": 0, "processed_num": 24}
    for r in range(3):  # a reset to 3 ranks: the 36 samples left, 12 each
        _pretend_world(monkeypatch, r, 3)
        s = ElasticSampler(data, seed=5)
        s.load_state_dict(state)
        assert len(s) == 12
        seen += list(s)
    assert sorted(seen) == data  # each sample of the epoch once, across the change of size
    s.set_epoch(1)
    assert s.state_dict() == {"epoch": 1, "processed_num": 0} and len(s) == 20


def test_fusion_sends_complete_buckets_in_order_while_backward_runs():
    """DistributedOptimizer's (and the hvd strategy's) overlap (strategies/hvd.py's GradientFusion),
    without a process group: a fake reduction records what is sent and doubles it."""
    from dtrain.strategies.hvd import GradientFusion

    sizes = {"first": 80, "cap": 80}  # one Linear(4, 4) a bucket: 20 float32
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4), torch.nn.Tanh(),
                                torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))  # the last gets no gradient
    params = list(model.parameters())
    sent: list[torch.Tensor] = []
    fusion = GradientFusion(params, 1, launch=lambda flat: sent.append(flat.clone()) or len(sent) - 1,
                            finish=lambda flat, i: flat * 2, **sizes)
    fusion.register_hooks()
    first_layer_done: list[int] = []
    params[0].register_post_accumulate_grad_hook(lambda p: first_layer_done.append(len(sent)))
    model[:5](torch.randn(8, 4)).square().sum().backward()
    grads = [p.grad.clone() if p.grad is not None else None for p in params]
    # Buckets, last layers first: the unused layer, then the third, second and first (bias, weight each).
    assert [len(b.params) for b in fusion.buckets] == [2, 2, 2, 2]
    assert fusion.buckets[0].params == [params[7], params[6]] and fusion.buckets[3].params == [params[1], params[0]]
    assert sent == [] and first_layer_done == [0]  # bucket 0 never completes: nothing may go before it
    fusion.flush()  # sends all four in order, the unused layer's as zeros
    assert len(sent) == 4 and torch.equal(sent[0], torch.zeros(20))
    assert torch.equal(sent[1], torch.cat([grads[5].flatten(), grads[4].flatten()]))
    for p, g in zip(params[:6], grads[:6]):
        assert torch.equal(p.grad, 2 * g)
    assert torch.equal(params[6].grad, torch.zeros(4, 4))  # as Horovod: a zero gradient for the unused layer
    fusion.remove_hooks()

    sent.clear()
    used = GradientFusion(params[:6], 1, launch=lambda flat: sent.append(flat.clone()) or len(sent) - 1,
                          finish=lambda flat, i: flat, **sizes)
    used.register_hooks()
    first_layer_done.clear()
    model.zero_grad()
    model[:5](torch.randn(8, 4)).square().sum().backward()
    assert first_layer_done == [2]  # two buckets went out before backward reached the first layer
    assert len(sent) == 3 and used.in_flight()
    used.flush()
    assert len(sent) == 3 and not used.in_flight()
    used.remove_hooks()
