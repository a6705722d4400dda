"""The subset comparison that decides whether a write is needed."""

from __future__ import annotations

from ember_operator.apply import matches


def test_server_defaults_do_not_count_as_drift() -> None:
    desired = {
        "spec": {"ports": [{"name": "http", "port": 8080}]},
        "metadata": {"labels": {"a": "b"}},
    }
    live = {
        "spec": {
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "clusterIP": "10.0.0.1",
        },
        "metadata": {"labels": {"a": "b"}, "resourceVersion": "7"},
    }
    assert matches(desired, live)


def test_quantities_compare_by_value() -> None:
    assert matches({"memory": "1024Mi", "cpu": "1000m"}, {"memory": "1Gi", "cpu": "1"})
    assert not matches({"memory": "1025Mi"}, {"memory": "1Gi"})


def test_hand_edits_and_deletions_are_drift() -> None:
    desired = {"spec": {"replicas": 2, "template": {"containers": [{"image": "a"}]}}}
    assert not matches(
        desired, {"spec": {"replicas": 5, "template": {"containers": [{"image": "a"}]}}}
    )
    assert not matches(
        desired, {"spec": {"replicas": 2, "template": {"containers": [{"image": "b"}]}}}
    )
    assert not matches(desired, {"spec": {"replicas": 2, "template": {"containers": []}}})
    assert not matches(desired, None)
