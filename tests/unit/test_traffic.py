from grace_legacy.runtime.traffic import TrafficStats


def test_totals_routes_and_breakdowns():
    stats = TrafficStats()
    stats.record(dense_bytes=400, sent_bytes=40, route="allgather", labels={"group": 1})
    stats.record(dense_bytes=100, sent_bytes=100, route="dense", labels={"group": 0})
    out = stats.as_dict()
    assert (out["bytes_sent"], out["bytes_dense"], out["tensors"]) == (140, 500, 2)
    assert out["volume"] == 140 / 500
    assert out["tensors_by_route"] == {"allgather": 1, "dense": 1}
    assert out["group"][1]["volume"] == 0.1 and list(out["group"]) == [0, 1]
    restored = TrafficStats()
    restored.load_state_dict(stats.state_dict())
    assert restored.as_dict() == out


def test_empty_stats_have_zero_volume():
    assert TrafficStats().as_dict()["volume"] == 0.0
