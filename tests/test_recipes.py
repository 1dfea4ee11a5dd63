"""The training recipes: NxD's schedule float for float, its weight-decay rule, and how a recipe
fills only the options the command line leaves out."""

from __future__ import annotations

import torch

from neuron_ckpt.train import RECIPES, LRSchedule, param_groups

from .tutorial_run import train_module


def test_nxd_schedule_is_transformers_linear_schedule_step_for_step():
    """transformers' LambdaLR starts at lambda(0) = 0: the first optimizer.step() runs at lr 0,
    then scheduler.step() sets the next. Our lr(k) is the rate of step k (0-based, the (k+1)-th)."""
    from transformers import get_linear_schedule_with_warmup

    peak, warmup, total = 3e-4, 100, 10_000
    recipe = RECIPES["nxd"]
    ours = LRSchedule(peak, warmup, total, recipe.settings["decay"], recipe.settings["min_lr_ratio"],
                      recipe.warmup_from_zero)  # fmt: skip
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    theirs = get_linear_schedule_with_warmup(optimizer, warmup, total)
    got, want = [], []
    for k in range(total + 5):  # a few past the end: both stay at 0
        want.append(optimizer.param_groups[0]["lr"])  # what optimizer.step() number k+1 uses
        got.append(ours.lr(k))
        optimizer.step()
        theirs.step()
    assert got[0] == want[0] == 0.0 and got[1] == want[1] == peak / warmup
    assert got[warmup] == peak and got[total] == 0.0
    assert got == want  # exact, every step


def test_default_schedule_spends_no_step_at_rate_zero():
    s = LRSchedule(1.0, 4, 14, "linear", 0.0)
    assert [s.lr(k) for k in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    z = LRSchedule(1.0, 4, 14, "linear", 0.0, warmup_from_zero=True)
    assert [z.lr(k) for k in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)  # weight decays, bias does not
        self.input_layernorm = torch.nn.LayerNorm(4)  # neither
        self.scale = torch.nn.Parameter(torch.ones(4))  # 1-D, but not named bias/norm


def test_nxd_exempts_bias_and_norm_names_default_exempts_1d():
    block = _Block()
    ids = lambda group: {id(p) for p in group["params"]}  # noqa: E731
    names = {id(p): n for n, p in block.named_parameters()}
    nxd_decay, nxd_free = (sorted(names[i] for i in ids(g)) for g in param_groups(block, 0.01, "bias_norm_names"))
    assert nxd_decay == ["proj.weight", "scale"]
    assert nxd_free == ["input_layernorm.bias", "input_layernorm.weight", "proj.bias"]
    default_decay = sorted(names[i] for i in ids(param_groups(block, 0.1, "1d")[0]))
    assert default_decay == ["proj.weight"]
    assert [g["weight_decay"] for g in param_groups(block, 0.01, "bias_norm_names")] == [0.01, 0.0]


def test_recipe_fills_only_the_options_not_given():
    parse = train_module().parse_args
    default, nxd = parse([]), parse(["--recipe", "nxd"])
    picked = lambda c: (c.decay, c.min_lr_ratio, c.weight_decay, c.beta2, c.adam_eps, c.seed, c.data_order)  # noqa: E731
    assert picked(default) == ("cosine", 0.1, 0.1, 0.95, 1e-8, 1234, "shuffled")
    assert picked(nxd) == ("linear", 0.0, 0.01, 0.999, 1e-6, 12349, "sequential")
    # Given explicitly, even when equal to the default recipe's value: the command line wins.
    mixed = parse(["--recipe", "nxd", "--seed", "1234", "--beta2", "0.95", "--data-order", "shuffled"])
    assert picked(mixed) == ("linear", 0.0, 0.01, 0.95, 1e-6, 1234, "shuffled")
    # The recipe's floor does not count as given: --decay constant alone is fine.
    assert parse(["--recipe", "nxd", "--decay", "constant"]).decay == "constant"
