"""Reversible layers: the recomputing backward gives the ordinary autograd gradients, with less saved."""

from __future__ import annotations

import pytest
import torch


def saved_bytes_and_grads(model, ids, mask, *, memory_saving: bool, hashes: int):
    """Run one training step's forward + backward; return activation bytes autograd saved and all gradients."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)  # the same dropout masks for both paths
    storages = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # saved too, but not activations

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model.yoso.embeddings(ids)
        out = model.yoso.encoder(hidden, mask.bool(), hashes, memory_saving=memory_saving)
        loss = (out * torch.linspace(-1, 1, out.shape[-1])).pow(2).mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return sum(storages.values()), grads, out.detach()


@pytest.mark.parametrize("attention_type,hashes", [("yoso", 4), ("softmax", 0), ("reformer", 0)])
def test_reversible_backward_equals_ordinary_autograd(attention_type, hashes, kit):
    model = kit.tiny_model(attention_type, num_hidden_layers=4, reversible=True, hidden_dropout_prob=0.1,
                           attention_probs_dropout_prob=0.1).train()
    ids, mask = kit.pad_batch(kit.random_ids([40, 64, 17], seed=8))
    saved_rev, grads_rev, out_rev = saved_bytes_and_grads(model, ids, mask, memory_saving=True, hashes=hashes)
    saved_plain, grads_plain, out_plain = saved_bytes_and_grads(model, ids, mask, memory_saving=False, hashes=hashes)
    torch.testing.assert_close(out_rev, out_plain, atol=0, rtol=0)
    assert grads_rev.keys() == grads_plain.keys()
    layer_params = [n for n in grads_plain if ".encoder.layer." in n]
    assert len(layer_params) >= 4 * 16 - 8  # every layer's weights got a gradient (key unused by reformer)
    for name in grads_plain:
        torch.testing.assert_close(grads_rev[name], grads_plain[name], atol=1e-5, rtol=1e-4, msg=name)
    assert saved_rev < 0.4 * saved_plain  # activations kept for one output, not for every layer
    print(f"\n{attention_type}: saved for backward {saved_plain / 2**20:.2f} MiB ordinary, "
          f"{saved_rev / 2**20:.2f} MiB reversible")


def test_reversible_is_a_different_function_but_deterministic_in_eval(kit):
    ids, mask = kit.pad_batch(kit.random_ids([30, 12]))
    ordinary = kit.tiny_model("softmax", seed=3)
    reversible = kit.tiny_model("softmax", seed=3, reversible=True)
    assert ordinary.state_dict().keys() == reversible.state_dict().keys()  # same weights, pre-LN wiring
    with torch.no_grad():
        a, b = reversible.last_hidden(ids, mask), reversible.last_hidden(ids, mask)
        alone = reversible.last_hidden(ids[1:, :12], mask[1:, :12])
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(a[1, :12], alone[0], atol=1e-5, rtol=1e-5)
    assert (a - ordinary.last_hidden(ids, mask)).abs().max() > 0.01  # small: the 0.02-std init barely moves x


def test_reversible_layers_train_behind_frozen_embeddings(kit):
    model = kit.tiny_model("yoso", reversible=True).train()
    model.yoso.embeddings.requires_grad_(False)
    ids, mask = kit.pad_batch(kit.random_ids([20, 9]))
    model.last_hidden(ids, mask, hashes=4).pow(2).mean().backward()
    grads = [p.grad for p in model.yoso.encoder.parameters()]
    assert all(g is not None for g in grads) and any(g.abs().max() > 0 for g in grads)
