"""FSDP vs single-process equivalence: the batch size and the comparison."""

import torch

from helpers.fsdp_harness import relative_error

RTOL = 1e-5


NUM_SEQS = 8


def assert_matches(result, reference):
    for name, ref in reference["outputs"].items():
        assert relative_error(result["outputs"][name], ref) <= RTOL, name
    for name, ref_values in reference["metrics"].items():
        if name.endswith("lr") or name.endswith("skipped_steps"):
            continue
        torch.testing.assert_close(
            torch.tensor(result["metrics"][name]), torch.tensor(ref_values), rtol=RTOL, atol=1e-7, msg=name
        )
    assert result["grads"].keys() == reference["grads"].keys()
    errors = {k: relative_error(result["grads"][k], ref) for k, ref in reference["grads"].items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= RTOL, f"gradient differs: {worst} relative error {errors[worst]:.2e}"
