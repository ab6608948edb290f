"""usp sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` before CUDA starts, unless the user set it."""

from __future__ import annotations

import logging

from usp.parallel.process_group import ALLOC_CONF, ALLOC_CONF_VAR, configure_cuda_allocator


def test_unset_variable_gets_expandable_segments(caplog):
    env: dict[str, str] = {}
    with caplog.at_level(logging.INFO, logger="usp.parallel.process_group"):
        assert configure_cuda_allocator(env) == ALLOC_CONF == "expandable_segments:True"
    assert env == {ALLOC_CONF_VAR: ALLOC_CONF}
    assert "set by usp" in caplog.text


def test_user_setting_is_kept_and_logged(caplog):
    env = {ALLOC_CONF_VAR: "max_split_size_mb:512"}
    with caplog.at_level(logging.INFO, logger="usp.parallel.process_group"):
        assert configure_cuda_allocator(env) == "max_split_size_mb:512"
    assert env == {ALLOC_CONF_VAR: "max_split_size_mb:512"}
    assert "set by the user" in caplog.text
