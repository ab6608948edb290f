"""usp.parallel.agree: a failure on one rank is raised on every rank, with the failing rank's message."""

from __future__ import annotations

import pytest

from usp.parallel.agree import on_every_rank, on_rank0, raise_if_any_failed


def _cases() -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    out: dict = {}

    def catch(key, fn):
        try:
            out[key] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            out[key] = (type(e).__name__, str(e))

    catch("none_failed", lambda: raise_if_any_failed(None, "saving"))
    catch("value_on_2", lambda: raise_if_any_failed(ValueError("bad path") if rank == 2 else None, "saving"))
    catch(
        "os_on_1_3", lambda: raise_if_any_failed(OSError("disk full") if rank in (1, 3) else None, "saving")
    )
    catch("rank0_result", lambda: on_rank0(lambda: {"path": "/data", "rank": dist.get_rank()}, "preparing"))

    def fail0():
        raise ValueError("no such dataset")

    catch("rank0_error", lambda: on_rank0(fail0, "preparing"))

    def fail_on_3():
        if rank == 3:
            raise KeyError("boom")
        return rank

    catch("every_rank", lambda: on_every_rank(fail_on_3, "loading"))
    return out


def test_errors_reach_every_rank(dist_pools):
    results = dist_pools(4).run(_cases, timeout=120)
    for rank, out in enumerate(results):
        assert out["none_failed"] == ("ok", None)
        kind, msg = out["value_on_2"]
        assert kind == "ValueError" and "saving failed on rank 2: ValueError: bad path" in msg
        kind, msg = out["os_on_1_3"]
        assert kind == "RuntimeError" and "rank(s) [1, 3] (first: rank 1)" in msg and "disk full" in msg
        assert out["rank0_result"] == ("ok", {"path": "/data", "rank": 0})
        kind, msg = out["rank0_error"]
        assert kind == "ValueError" and "no such dataset" in msg
        kind, msg = out["every_rank"]
        if rank == 3:
            assert kind == "KeyError"  # the failing rank keeps its own exception
        else:
            assert kind == "RuntimeError" and "loading failed on rank 3: KeyError" in msg


def test_without_a_process_group_they_simply_run_or_raise():
    raise_if_any_failed(None, "x")
    with pytest.raises(ValueError, match="x failed: ValueError: bad"):
        raise_if_any_failed(ValueError("bad"), "x")
    assert on_rank0(lambda: 5, "x") == 5 and on_every_rank(lambda: 6, "x") == 6
