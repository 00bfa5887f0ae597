"""Flat parameter storage (``lightning_gossip.flat.flatten_module_``): the replica's tensors
are views of one buffer per dtype, set up by the gossip strategies before the optimizers.

The unit tests check the layout and that :class:`~lightning_gossip.flat.FlatState` gives the
same values with and without it. The multi-process test (this file is also the rank script)
trains the same model with and without flat storage on 2 gloo ranks and compares the results:
optimizers from ``configure_optimizers`` with two param groups, gradient clipping, tied weights,
BatchNorm buffers, ``bf16-mixed``, ``bf16-true``, manual optimization, checkpoints and resume.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_gossip.flat import FlatState, flatten_module_, mixed_tensors


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.Linear(4, 2))
    m[2].weight = m[0].weight  # tied
    return m


def _storages(state: FlatState) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in state.tensors}


# -- unit tests ---------------------------------------------------------------------------------
def test_views_share_one_storage_and_values_are_unchanged():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    assert flatten_module_(model) == 1
    after = model.state_dict()
    assert list(after) == list(before)  # keys, in order
    for k, v in before.items():
        assert after[k].shape == v.shape and after[k].dtype == v.dtype
        assert torch.equal(after[k], v), k
    assert list(model.parameters()) == params and all(  # the same Parameter objects
        a is b for a, b in zip(model.parameters(), params))
    assert model[2].weight is model[0].weight
    state = FlatState(model)
    assert state.is_flat and len(state.segments) == 1
    assert len(_storages(state)) == 1  # every mixed tensor in one storage
    assert _storages(state) == {state.segments[0].target.untyped_storage().data_ptr()}
    assert model[1].num_batches_tracked.untyped_storage().data_ptr() not in _storages(state)
    assert all(t.is_contiguous() for t in state.tensors)
    assert flatten_module_(model) == 1 and FlatState(model).tensors[0].data_ptr() == (
        state.tensors[0].data_ptr())  # again: nothing moves


def test_flat_and_plain_give_the_same_values():
    plain, flat = _model(), _model()
    flatten_module_(flat)
    a, b = FlatState(plain), FlatState(flat)
    assert not a.is_flat and b.is_flat
    assert torch.equal(a.pack(), b.pack())
    delta = torch.randn(a.numel, generator=torch.Generator().manual_seed(1))
    a.add_(delta)
    b.add_(delta)
    assert torch.equal(a.pack(), b.pack())
    out = b.empty()
    assert b.pack(out=out) is out and torch.equal(out, a.pack())
    a.copy_(delta * 2)
    b.copy_(delta * 2)
    assert torch.equal(a.pack(), b.pack()) and torch.equal(b.pack(), delta * 2)
    for (na, ta), (nb, tb) in zip(mixed_tensors(plain), mixed_tensors(flat)):
        assert na == nb and torch.equal(ta, tb)


def test_optimizer_built_after_flattening_updates_the_buffer():
    model = _model()
    flatten_module_(model)
    state = FlatState(model)
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                           {"params": model[3].parameters(), "lr": 0.01}], momentum=0.9)
    before = state.pack()
    model(torch.randn(8, 4)).sum().backward()
    nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    assert not torch.equal(state.pack(), before)
    assert len(_storages(state)) == 1 and state._fast()  # still flat after a step


def test_low_precision_gets_one_buffer_per_dtype_and_packs_fp32():
    model = _model().to(torch.bfloat16)
    model[1].running_var.data = model[1].running_var.data.float()  # a second dtype
    ref = FlatState(_model().to(torch.bfloat16))
    ref.tensors[-1].data = ref.tensors[-1].data.float()
    assert flatten_module_(model) == 2
    state = FlatState(model)
    assert {s.target.dtype for s in state.segments} == {torch.bfloat16, torch.float32}
    assert len(_storages(state)) == 2
    x = state.pack()
    assert x.dtype == torch.float32 and torch.equal(x, ref.pack())
    delta = torch.full_like(x, 0.3)
    state.add_(delta)
    ref.add_(delta)
    assert torch.equal(state.pack(), ref.pack())
    state.copy_(x)
    ref.copy_(x)
    assert torch.equal(state.pack(), ref.pack())


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


@pytest.mark.parametrize("dtypes", ["fp32", "bf16+fp32", "fp16+fp64"])
@pytest.mark.parametrize("layout", ["plain", "flat"])
def test_pack_plus_is_pack_then_add_bit_for_bit(dtypes, layout):
    """``pack(out, plus)`` (one fused pass per buffer with flat storage) equals ``pack(out)``
    then ``add_(plus)`` in every bit, for every dtype mix (fp64 is not fused)."""
    model = _model()
    if dtypes != "fp32":
        low, high = (torch.bfloat16, torch.float32) if dtypes == "bf16+fp32" else (
            torch.float16, torch.float64)
        model = model.to(low)
        model[1].running_var.data = model[1].running_var.data.to(high)
    if layout == "flat":
        flatten_module_(model)
    state = FlatState(model)
    assert state.is_flat == (layout == "flat")
    g = torch.Generator().manual_seed(3)
    plus = torch.randn(state.numel, generator=g) * torch.rand(state.numel, generator=g) ** 9
    plus[:3] = torch.tensor([-0.0, 0.0, 1e-30])
    expected = state.pack().add_(plus)
    out = torch.full((state.numel,), float("nan"))
    assert state.pack(out=out, plus=plus) is out
    assert torch.equal(_bits(out), _bits(expected))
    assert torch.equal(_bits(state.pack(plus=plus)), _bits(expected))


def test_non_contiguous_and_overlapping_tensors_keep_their_memory():
    model = _model()
    w = model[3].weight
    w.data = w.data.t().contiguous().t()  # non-contiguous (like channels-last)
    model.register_buffer("alias", model[0].bias.data[:2])  # overlaps a parameter
    flatten_module_(model)
    assert not model[3].weight.is_contiguous()
    assert model.alias.data_ptr() == model[0].bias.data_ptr()  # still a view of it
    plain = _model()
    plain[3].weight.data = plain[3].weight.data.t().contiguous().t()
    plain.register_buffer("alias", plain[0].bias.data[:2])
    a, b = FlatState(plain), FlatState(model)
    assert torch.equal(a.pack(), b.pack())
    a.add_(torch.ones(a.numel))
    b.add_(torch.ones(b.numel))
    assert torch.equal(a.pack(), b.pack())


def test_storage_lost_after_set_up_falls_back_with_a_warning():
    model = _model()
    flatten_module_(model)
    state = FlatState(model)
    x = state.pack()
    model[3].weight.data = model[3].weight.data.clone()  # as model.to(other device) would
    with pytest.warns(UserWarning, match="per-tensor copies"):
        assert torch.equal(state.pack(), x)
    state.add_(torch.ones_like(x))
    assert torch.equal(state.pack(), x + 1)
    i = next(i for i, t in enumerate(state.tensors) if t is model[3].weight)
    assert torch.equal(model[3].weight.detach(), state.views(x + 1)[i])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state.pack()  # warned once


# -- multi-process: the same training with and without flat storage ------------------------------
CASES = ("groups_clip", "bf16_mixed", "manual", "bf16_true")
_STATE_KEYS = ("state_dict",)


def _rank_main(out: Path) -> None:  # pragma: no cover - runs in the launched ranks
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_gossip.strategies.adpsgd import ADPSGDStrategy
    from lightning_gossip.strategies.dpsgd import DPSGDStrategy

    class Net(L.LightningModule):
        def __init__(self, manual: bool = False) -> None:
            super().__init__()
            self.net = _model()
            self.automatic_optimization = not manual

        def training_step(self, batch: Any, _: int) -> Any:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x).float(), y)
            if self.automatic_optimization:
                return loss
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            return None

        def configure_optimizers(self) -> Any:
            net = self.net
            return torch.optim.SGD([
                {"params": [*net[0].parameters(), *net[1].parameters()], "lr": 0.2},
                {"params": [net[2].bias, *net[3].parameters()], "lr": 0.05},
            ], momentum=0.9)

    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    rank = int(__import__("os").environ["RANK"])
    results: dict[str, Any] = {}

    def fit(name: str, flat: bool, *, precision: str = "32-true", manual: bool = False,
            epochs: int = 2, resume: str | None = None, adpsgd: bool = False) -> Any:
        L.seed_everything(0, verbose=False)
        model = Net(manual)
        strategy = (ADPSGDStrategy(consensus_every_n_steps=None) if adpsgd else
                    DPSGDStrategy(topology="ring", final_average=False,
                                  consensus_every_n_steps=None))
        strategy._flat_storage = flat
        trainer = L.Trainer(
            strategy=strategy, accelerator="cpu", devices=2, max_epochs=epochs,
            precision=precision, limit_val_batches=0, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False,
            gradient_clip_val=None if manual else 0.5, default_root_dir=out / name)
        trainer.fit(model, DataLoader(data, batch_size=8), ckpt_path=resume)
        ckpt = out / f"{name}.ckpt"
        trainer.save_checkpoint(ckpt)
        state = strategy._flat
        opt_params = [p for grp in trainer.optimizers[0].param_groups for p in grp["params"]]
        mine = {id(t) for t in state.tensors}
        results[name] = {
            "weights": {k: v.detach().clone().float()
                        for k, v in model.state_dict().items()},
            "segments": len(state.segments),
            "storages": len({t.untyped_storage().data_ptr() for t in state.tensors}),
            "dtypes": sorted({str(s.target.dtype) for s in state.segments}),
            "opt_params_are_module_params": all(id(p) in mine for p in opt_params),
            "opt_params_storages": len({p.untyped_storage().data_ptr() for p in opt_params}),
            "tied": model.net[2].weight is model.net[0].weight,
            "global_step": trainer.global_step,
            "ckpt": str(ckpt),
        }

    for flat in (True, False):
        tag = "flat" if flat else "plain"
        fit(f"groups_clip_{tag}", flat)
        fit(f"resume_{tag}", flat, epochs=3, resume=str(out / f"groups_clip_{tag}.ckpt"))
        fit(f"bf16_mixed_{tag}", flat, precision="bf16-mixed")
        fit(f"manual_{tag}", flat, manual=True)
        fit(f"bf16_true_{tag}", flat, precision="bf16-true")
    fit("adpsgd_flat", True, adpsgd=True)
    torch.save(results, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from testbed.launch import check, run_torchrun

    out = tmp_path_factory.mktemp("flat_storage")
    check(run_torchrun("tests.test_flat_storage", str(out), nprocs=2, timeout=900))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert list(a) == list(b), what
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, (what, k)
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=f"{what}: {k}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [*CASES, "resume"])
def test_training_with_flat_storage_equals_training_without(trained, case):
    for rank, res in enumerate(trained):
        flat, plain = res[f"{case}_flat"], res[f"{case}_plain"]
        assert flat["global_step"] == plain["global_step"] > 0
        assert plain["segments"] > 2 and flat["storages"] == 1
        assert flat["segments"] == 1 and flat["opt_params_storages"] == 1
        assert flat["dtypes"] == (["torch.bfloat16"] if case == "bf16_true"
                                  else ["torch.float32"])
        assert flat["opt_params_are_module_params"] and flat["tied"] and plain["tied"]
        _assert_same_state(flat["weights"], plain["weights"], f"rank {rank} {case} weights")
        ck_flat = torch.load(flat["ckpt"], weights_only=False)
        ck_plain = torch.load(plain["ckpt"], weights_only=False)
        _assert_same_state(ck_flat["state_dict"], ck_plain["state_dict"],
                           f"rank {rank} {case} checkpoint")
        for sa, sb in zip(ck_flat["optimizer_states"], ck_plain["optimizer_states"]):
            assert sa["param_groups"] == sb["param_groups"]
            for i, st in sa["state"].items():
                torch.testing.assert_close(st["momentum_buffer"],
                                           sb["state"][i]["momentum_buffer"], rtol=0, atol=0)


@pytest.mark.multiprocess
def test_adpsgd_trains_with_flat_storage(trained):
    for res in trained:
        r = res["adpsgd_flat"]
        assert r["global_step"] > 0 and r["segments"] == 1 and r["storages"] == 1
        assert r["opt_params_are_module_params"] and r["tied"]
        assert all(torch.isfinite(v).all() for v in r["weights"].values())


if __name__ == "__main__":  # the rank script of ``trained``
    _rank_main(Path(sys.argv[1]))
