"""The loss and advantage registry: built-in names, `pkg.mod:fn`, one-line errors."""

from __future__ import annotations

import textwrap

import pytest
import torch

from areal.algo import names, registry
from areal.algo.loss import LossInput, LossOutput, PPOLossConfig
from areal.algo.registry import (
    compute_advantages,
    compute_loss,
    resolve_advantage,
    resolve_loss,
)


def test_builtin_names_match_the_torch_free_list() -> None:
    assert tuple(registry.LOSSES) == names.LOSS_NAMES
    assert tuple(registry.ADVANTAGES) == names.ADVANTAGE_NAMES
    for name in names.LOSS_NAMES:
        assert resolve_loss(name) is registry.LOSSES[name]
        assert registry.LOSSES[name].__doc__ and "arXiv" in registry.LOSSES[name].__doc__
    for name in names.ADVANTAGE_NAMES:
        assert "arXiv" in (resolve_advantage(name).__doc__ or "")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module `my_algo_<test>` in tmp_path, on sys.path."""

    def write(name: str, body: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
        monkeypatch.syspath_prepend(str(tmp_path))
        return name

    return write


def one_token_input(adv: float = 1.0) -> LossInput:
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    return LossInput(
        logp=logp,
        prox_logp=torch.tensor([-1.0, -2.0]),
        behav_logp=torch.tensor([-1.0, -2.0]),
        adv=torch.tensor([adv, adv]),
        mask=torch.tensor([True, False]),
        seq_ids=torch.tensor([0, 0]),
        versions=torch.tensor([0, 0]),
        loss_denominator=1.0,
    )


def test_user_loss_returning_a_tensor_gets_the_generic_stats(user_module) -> None:
    mod = user_module(
        "my_algo_loss",
        """
        def reinforce(inp, cfg):
            # plain REINFORCE: -A * logp on the loss tokens
            return -(inp.adv * inp.logp * inp.mask).sum() / inp.loss_denominator
        """,
    )
    cfg = PPOLossConfig(loss=f"{mod}:reinforce")
    inp = one_token_input(adv=2.0)
    out = compute_loss(inp, cfg)
    # -2 * -1 on the one loss token = 2
    assert isinstance(out, LossOutput) and out.loss.item() == pytest.approx(2.0)
    assert (out.n_tokens, out.n_kept, out.approx_kl_sum, out.imp_weight_sum) == (1, 1, 0.0, 1.0)
    out.loss.backward()
    assert inp.logp.grad.tolist() == [-2.0, 0.0]


def test_user_advantage(user_module) -> None:
    mod = user_module(
        "my_algo_adv",
        """
        def centred(rewards):
            return rewards - rewards.mean(dim=1, keepdim=True)

        def wrong_shape(rewards):
            return rewards.flatten()
        """,
    )
    fn = resolve_advantage(f"{mod}:centred")
    torch.testing.assert_close(
        compute_advantages(fn, torch.tensor([[1.0, 3.0]])), torch.tensor([[-1.0, 1.0]])
    )
    with pytest.raises(ValueError, match="rewards' shape"):
        compute_advantages(resolve_advantage(f"{mod}:wrong_shape"), torch.ones(2, 2))


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("nope", "use one of ppo, gspo"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("{mod}:missing", "has no attribute 'missing'"),
        ("{mod}:one_arg", "is not a function"),
        ("{mod}_broken:fn", "raised ZeroDivisionError"),
    ],
)
def test_bad_loss_specs_fail_in_one_line(user_module, spec, match) -> None:
    mod = user_module("my_algo_bad", "def one_arg(inp):\n    return inp\n")
    user_module("my_algo_bad_broken", "1 / 0\n")
    with pytest.raises(ValueError, match=match) as e:
        resolve_loss(spec.format(mod=mod))
    assert "\n" not in str(e.value) and str(e.value).startswith("algo.loss=")


def test_bad_advantage_spec_names_its_setting() -> None:
    with pytest.raises(ValueError, match=r"^algo.advantage='gae': use one of grpo, dr_grpo"):
        resolve_advantage("gae")


def test_user_loss_of_the_wrong_type_is_refused(user_module) -> None:
    mod = user_module("my_algo_type", "def f(inp, cfg):\n    return 1.0\n")
    with pytest.raises(TypeError, match="return a LossOutput or a scalar tensor"):
        compute_loss(one_token_input(), PPOLossConfig(loss=f"{mod}:f"))
