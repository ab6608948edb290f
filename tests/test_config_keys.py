"""Every override lands on a schema field or fails, naming the real key (usp.config.keys)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from usp.config import TrainConfig
from usp.config.compose import compose_config
from usp.config.keys import FOREIGN_KEYS, check_composed_keys, schema_keys


@pytest.mark.parametrize(
    "override, expected",
    [
        ("+trainer.gradient_accumulation_steps=4", "usp calls it trainer.grad_accum_steps"),
        ("trainer.gradient_accumulation_steps=4", "usp calls it trainer.grad_accum_steps"),
        ("+parallel.context_parallel_degree=4", "parallel.ring_degree"),
        ("+parallel.sequence_parallel_degree=8", "parallel.ulysses_degree x parallel.ring_degree"),
        ("+trainer.save_total_limit=3", "usp calls it trainer.keep_last"),
        ("trainer.max_step=3", "did you mean trainer.max_steps?"),
        ("+optim.grad_accum_steps=2", "did you mean trainer.grad_accum_steps?"),
        ("+foo=1", "unknown config key 'foo'"),
        ("+trainer.micro_batch=2", "did you mean trainer.micro_batch_size?"),
        ("+eval.batch_size=2", "did you mean eval.micro_batch_size?"),  # the same group before foreign names
    ],
)
def test_unknown_override_is_an_error_naming_the_real_key(override, expected):
    with pytest.raises(ValueError, match="unknown config key") as err:
        compose_config(["recipe=tiny", override])
    assert expected in str(err.value)


def test_known_keys_and_open_dicts_pass():
    cfg = compose_config(
        [
            "recipe=tiny",
            "trainer.grad_accum_steps=2",
            "hydra.run.dir=/tmp/x",
            "+model.tiny_size.rope_theta=5000.0",
            "data=tiny",
        ]
    )
    assert cfg.trainer.grad_accum_steps == 2 and cfg.model.tiny_size["rope_theta"] == 5000.0


def test_composed_config_with_an_extra_key_is_rejected():
    """The check on the composed config itself (a key appended by any route, not only the command line)."""
    cfg = OmegaConf.create({"trainer": {"max_steps": 3, "gradient_accumulation_steps": 4}, "run_dir": "."})
    with pytest.raises(ValueError, match="trainer.grad_accum_steps"):
        check_composed_keys(cfg, TrainConfig)
    check_composed_keys(OmegaConf.create({"model": {"rope_scaling": {"anything": 1}}}), TrainConfig)


def test_foreign_names_point_at_real_keys():
    fields, _ = schema_keys(TrainConfig)
    for name, target in FOREIGN_KEYS.items():
        assert name not in {f.rsplit(".", 1)[-1] for f in fields} or name in ("max_steps", "seed"), name
        first = target.split()[0].split("=")[0]
        assert first == "hydra.run.dir" or first in fields, (name, target)


def test_entry_point_exits_2_with_the_message():
    proc = subprocess.run(
        [sys.executable, "-m", "usp.train", "recipe=tiny", "+trainer.gradient_accumulation_steps=4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "usp calls it trainer.grad_accum_steps" in proc.stderr
    assert proc.stderr.count("unknown config key") == 1


def test_rope_scaling_can_be_set_on_the_command_line():
    """A dict for a field that defaults to null (OmegaConf cannot merge into a typed None dict node)."""
    cfg = compose_config(["recipe=tiny", "model.rope_scaling={rope_type: linear, factor: 4.0}"])
    assert cfg.model.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    cfg = compose_config(["recipe=tiny", "+model.rope_scaling.factor=2.0"])
    assert cfg.model.rope_scaling == {"factor": 2.0}
