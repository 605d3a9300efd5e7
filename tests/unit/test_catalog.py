import pytest

from proxy.fleet.catalog import ModelInfo, model_info


def test_model_info_from_tritons_json_config() -> None:
    info = model_info(
        {
            "max_batch_size": 16,
            # 64-bit ints may come as strings
            "dynamic_batching": {"priority_levels": "3", "max_queue_delay_microseconds": "2000"},
            "instance_group": [{"count": 2}, {"count": 1}],
            "model_transaction_policy": {"decoupled": True},
        }
    )
    assert info == ModelInfo(16, 3, 3, True, None, max_queue_delay_s=0.002)
    assert model_info({"dynamic_batching": {}}).max_queue_delay_s == 0.0
    assert model_info({}) == ModelInfo(0, 0, 1, False, None)


def corrid(data_type: str) -> ModelInfo:
    return model_info(
        {
            "sequence_batching": {
                "control_input": [
                    {"name": "START", "control": [{"kind": "CONTROL_SEQUENCE_START"}]},
                    {
                        "name": "CORRID",
                        "control": [{"kind": "CONTROL_SEQUENCE_CORRID", "data_type": data_type}],
                    },
                ]
            }
        }
    )


@pytest.mark.parametrize(
    ("info", "sequence_id", "refused"),
    [
        (corrid("TYPE_UINT64"), "session-7", True),
        (corrid("TYPE_UINT64"), 7, False),
        (corrid("TYPE_STRING"), "session-7", False),
        (model_info({"sequence_batching": {}}), "session-7", False),  # no CORRID input
    ],
)
def test_string_ids_refused_for_numeric_corrid(
    info: ModelInfo, sequence_id: int | str, refused: bool
) -> None:
    problem = info.sequence_id_problem(sequence_id)
    assert (problem is not None) == refused
    if refused:
        assert "TYPE_UINT64" in str(problem) and "integer" in str(problem)
