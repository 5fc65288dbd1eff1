# tools/hf_fixture.py — what the fixture scripts (tools/make_*_fixture.py)
# share: a transformers config with rope_parameters (or, before
# transformers 5, rope_theta and rope_scaling), the weights drawn again, a
# batch with about 10% of its targets ignored, and a case folder written
# (spec/fixtures/README.md says what it holds):
#   config.json          the config as transformers writes it
#   model.safetensors    the weights (in the checkpoints' names: `hub`)
#   expected.safetensors input_ids, targets (i64), logits, loss (mean
#                        cross-entropy over the targets kept) and
#                        grad.<name> for every parameter
# computed in float64, stored as float32 (as ../shared/fixtures).
import os
import re

import torch
import torch.nn.functional as F
from safetensors.torch import save_file


def make_config(Cfg, kw, rope, strict=False):
    # Cfg(**kw) with RoPE `rope` ({rope_type, rope_theta, ...}); eager
    # attention and the per-expert loop (torch's grouped_mm takes no float64).
    # strict: transformers 5's rope_parameters only.
    try:
        cfg = Cfg(**kw, rope_parameters=dict(rope))
        rp = getattr(cfg, 'rope_parameters', None)
        if not isinstance(rp, dict) or rp.get('rope_type') != rope['rope_type']:
            raise TypeError('rope_parameters not taken: %r' % (rp,))
    except TypeError:
        if strict:
            raise
        rs = None
        if rope['rope_type'] != 'default':
            rs = {k: v for k, v in rope.items() if k != 'rope_theta'}
            rs['type'] = rope['rope_type']
        cfg = Cfg(**kw, rope_theta=rope['rope_theta'], rope_scaling=rs)
    cfg._attn_implementation = 'eager'
    cfg._experts_implementation = 'eager'
    return cfg


def redraw(model, buffers=()):
    # every parameter drawn again so that none sits at a trivial value:
    # normal(0, 0.02) + normal(0, 0.05); norm weights 1 + normal(0, 0.05);
    # biases normal(0, 0.05); the buffers whose names end in one of
    # `buffers` normal(0, 0.05) too (DeepSeek-V3's routing biases)
    # (the parameters first, then the buffers: the order the fixtures drew)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(r'norm\.weight$', name):
                p.copy_(1 + torch.randn_like(p) * 0.05)
            elif name.endswith('.bias'):
                p.copy_(torch.randn_like(p) * 0.05)
            else:
                p.copy_(torch.randn_like(p) * 0.02 + torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith(tuple(buffers)):
                b.copy_(torch.randn_like(b) * 0.05)


def batch(vocab, T, B=2):
    # input_ids (B, T) and their next tokens as targets, about 10% -100
    ids = torch.randint(0, vocab, (B, T + 1))
    input_ids, targets = ids[:, :T].clone(), ids[:, 1:].clone()
    targets[torch.rand(B, T) < 0.1] = -100
    return input_ids, targets


def write_case(d, cfg, model, logits, input_ids, targets, hub=None):
    # the loss and its gradients, then d/ (config.json, model.safetensors,
    # expected.safetensors); hub(tensors) -> the checkpoints' names and
    # layouts of a {name: tensor} (weights and gradients alike). A tied
    # head is saved once, under the embedding's name. Returns the loss.
    V = cfg.vocab_size
    loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=-100)
    model.zero_grad()
    loss.backward()
    sd = {k: v.detach() for k, v in model.state_dict().items() if 'rotary' not in k and 'inv_freq' not in k}
    if cfg.tie_word_embeddings:
        sd.pop('lm_head.weight', None)
    grads = {k: p.grad.detach() for k, p in model.named_parameters()}
    if hub:
        sd, grads = hub(sd), hub(grads)
    exp = {'input_ids': input_ids, 'targets': targets, 'logits': logits.detach(), 'loss': loss.detach().reshape(1)}
    for k, g in grads.items():
        exp['grad.' + k] = g

    def f32(t):
        return t.float().contiguous() if t.is_floating_point() else t.contiguous()
    os.makedirs(d, exist_ok=True)
    save_file({k: f32(v) for k, v in sd.items()}, d + '/model.safetensors', metadata={'format': 'pt'})
    save_file({k: f32(v) for k, v in exp.items()}, d + '/expected.safetensors')
    cfg.save_pretrained(d)
    return loss, len(sd), len(grads)
