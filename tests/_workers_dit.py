"""Worker-side code of tests/test_dit.py: the joint-attention block sequence-parallel vs on one device."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import seqpar
from seqpar.integrations.dit import JointAttention, joint_attention
from seqpar.testing import rel_error

DIM, HEADS = 32, 4


def _mesh(spec: dict[str, Any]):
    """The sequence-parallel mesh; with ``dp`` the world splits into dp replicas of consecutive ranks."""
    dp, method = spec.get("dp", 1), spec["method"]
    if dp == 1:
        return seqpar.make_mesh(ulysses=spec.get("ulysses", 2), device_type="cpu") if method == "usp" else None
    from torch.distributed.device_mesh import init_device_mesh

    sp = dist.get_world_size() // dp
    if method == "usp":
        u = spec.get("ulysses", 2)
        return init_device_mesh("cpu", (dp, sp // u, u), mesh_dim_names=("dp", "ring", "ulysses"))["ring", "ulysses"]
    return init_device_mesh("cpu", (dp, sp), mesh_dim_names=("dp", "sp"))["sp"]


def _sum_over(t: torch.Tensor, mesh) -> torch.Tensor:
    t = t.clone()
    groups = [mesh.get_group(i) for i in range(mesh.ndim)] if mesh is not None else [dist.group.WORLD]
    for g in groups:
        dist.all_reduce(t, group=g)
    return t


def block_compare(spec: dict[str, Any]) -> dict[str, float]:
    """Outputs, input gradients and (group-summed) parameter gradients of JointAttention vs one device.

    The loss counts image outputs on their rank and text outputs once over the group (each rank adds 1/W of
    the text term): Note [Replicated text: partial-sum gradients].
    """
    dtype = getattr(torch, spec.get("dtype", "float64"))
    mesh = _mesh(spec)
    dp = dist.get_rank() // (dist.get_world_size() // spec.get("dp", 1))
    g = torch.Generator().manual_seed(7 + 100 * dp)
    B, N, T = spec.get("batch", 2), spec.get("image", 16), spec.get("text", 6)
    img, txt = torch.randn(B, N, DIM, generator=g, dtype=dtype), torch.randn(B, T, DIM, generator=g, dtype=dtype)
    g_img = torch.randn(img.shape, generator=g, dtype=dtype)
    g_txt = torch.randn(txt.shape, generator=g, dtype=dtype)

    torch.manual_seed(0)
    ref = JointAttention(DIM, HEADS, method=None).to(dtype)
    torch.manual_seed(0)
    sp = JointAttention(DIM, HEADS, mesh=mesh, method=spec["method"]).to(dtype)

    x_img, x_txt = img.clone().requires_grad_(), txt.clone().requires_grad_()
    r_img, r_txt = ref(x_img, x_txt)
    ((r_img * g_img).sum() + (r_txt * g_txt).sum()).backward()

    where = {"mesh": mesh, "method": spec["method"], "layout": "contiguous"}
    l_img = seqpar.shard(img, **where).requires_grad_()
    l_txt = txt.clone().requires_grad_()
    o_img, o_txt = sp(l_img, l_txt)
    world = seqpar.SeqParallelGroups.resolve(mesh, seqpar.methods.get(spec["method"]).mesh_dims).world
    ((o_img * seqpar.shard(g_img, **where)).sum() + (o_txt * g_txt).sum() / world).backward()

    errors = {"out_img": rel_error(seqpar.unshard(o_img.detach(), **where), r_img.detach()),
              "out_txt": rel_error(o_txt.detach(), r_txt.detach()),
              "d_img": rel_error(seqpar.unshard(l_img.grad, **where), x_img.grad),
              "d_txt": rel_error(_sum_over(l_txt.grad, mesh), x_txt.grad)}
    ref_params = dict(ref.named_parameters())
    for name, p in sp.named_parameters():
        errors[f"grad:{name}"] = rel_error(_sum_over(p.grad, mesh), ref_params[name].grad)
    # the text must matter: image outputs without the text keys differ (xDiT dropped the joint text K/V)
    with torch.no_grad():
        alone = JointAttention(DIM, HEADS, method=None).to(dtype)
        alone.load_state_dict(ref.state_dict())
        qi, ki, vi = alone._heads(img, alone.img_qkv, alone.img_q_norm, alone.img_k_norm)
        img_only = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qi, ki, vi)))
        img_only = alone.img_out(img_only.transpose(1, 2).flatten(2))
    errors["text_effect"] = rel_error(img_only, r_img.detach())
    return errors


def function_compare(spec: dict[str, Any]) -> dict[str, float]:
    """``joint_attention`` on heads (GQA allowed) vs dense attention over [text; image], with gradients."""
    dtype = getattr(torch, spec.get("dtype", "float64"))
    mesh = _mesh(spec)
    g = torch.Generator().manual_seed(3)
    B, N, T, H, Hkv, D = 1, spec.get("image", 16), spec.get("text", 5), 4, spec.get("kv_heads", 2), 8
    q = torch.randn(B, T + N, H, D, generator=g, dtype=dtype)
    k = torch.randn(B, T + N, Hkv, D, generator=g, dtype=dtype)
    v = torch.randn(B, T + N, Hkv, D, generator=g, dtype=dtype)
    do = torch.randn(q.shape, generator=g, dtype=dtype)
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    rep = H // Hkv
    ref = torch.nn.functional.scaled_dot_product_attention(
        qd.transpose(1, 2), kd.repeat_interleave(rep, 2).transpose(1, 2),
        vd.repeat_interleave(rep, 2).transpose(1, 2)).transpose(1, 2)
    (ref * do).sum().backward()

    where = {"mesh": mesh, "method": spec["method"], "layout": "contiguous"}
    img = [seqpar.shard(t[:, T:], **where).requires_grad_() for t in (q, k, v)]
    txt = [t[:, :T].clone().requires_grad_() for t in (q, k, v)]
    o_img, o_txt = joint_attention(*img, *txt, mesh=mesh, method=spec["method"])
    world = seqpar.SeqParallelGroups.resolve(mesh, seqpar.methods.get(spec["method"]).mesh_dims).world
    ((o_img * seqpar.shard(do[:, T:], **where)).sum() + (o_txt * do[:, :T]).sum() / world).backward()
    errors = {"out_img": rel_error(seqpar.unshard(o_img.detach(), **where), ref.detach()[:, T:]),
              "out_txt": rel_error(o_txt.detach(), ref.detach()[:, :T])}
    for name, loc, t, full in zip("qkv", img, txt, (qd, kd, vd)):
        errors[f"d{name}_img"] = rel_error(seqpar.unshard(loc.grad, **where), full.grad[:, T:])
        errors[f"d{name}_txt"] = rel_error(_sum_over(t.grad, mesh), full.grad[:, :T])
    return errors


def joint_error(spec: dict[str, Any]) -> tuple[str, str] | None:
    mesh = _mesh(spec)
    q = torch.zeros(1, 4, 4, 8)
    t = torch.zeros(1, spec["text"], 4, 8)
    try:
        joint_attention(q, q, q, t, t, t, mesh=mesh, method=spec["method"])
    except Exception as e:
        return type(e).__name__, str(e)
    return None
