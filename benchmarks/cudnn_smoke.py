import torch, math, tactix, traceback
from tactix.testing import attention_reference, relative_error

i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
g = torch.Generator().manual_seed(0)
for op in ("decode", "prefill"):
    for layout in ("HND", "NHD"):
        try:
            lens = [37, 100, 16, 300]
            q_lens = [1] * 4 if op == "decode" else [37, 100, 16, 300]
            pages = [-(-n // 16) for n in lens]
            total = sum(pages) + 3
            order = torch.randperm(total, generator=g).tolist()
            indptr = [0]
            idx = []
            for n in pages:
                idx += [order.pop() for _ in range(n)]
                indptr.append(len(idx))
            last = [(n - 1) % 16 + 1 for n in lens]
            qo = [0]
            for n in q_lens:
                qo.append(qo[-1] + n)
            shape = (total, 8, 16, 128) if layout == "HND" else (total, 16, 8, 128)
            k = torch.randn(shape, generator=g).cuda().bfloat16()
            v = torch.randn(shape, generator=g).cuda().bfloat16()
            q = torch.randn(qo[-1], 32, 128, generator=g).cuda().bfloat16()
            W = tactix.PagedPrefill if op == "prefill" else tactix.PagedDecode
            w = W(layout, backend="cudnn")
            meta = (i32(*indptr), i32(*idx), i32(*last))
            args = ((i32(*qo),) + meta) if op == "prefill" else meta
            kw = {"causal": True} if op == "prefill" else {}
            w.plan(*args, 32, 8, 128, 16, q_data_type=torch.bfloat16, return_lse=True, **kw)
            out, lse = w.run(q, (k, v))
            ref, rl = attention_reference(
                q, k, v, i32(*qo), *meta, kv_layout=layout, causal=op == "prefill", sm_scale=1 / math.sqrt(128)
            )
            print(op, layout, w.tactic, "err", relative_error(out, ref), "lse", (lse.double() - rl).abs().max().item())
            five = torch.stack([k, v], 1)
            out2 = w.run(q, five)[0]
            print("  5d err", relative_error(out2, ref))
        except Exception as e:
            traceback.print_exc()
            print(op, layout, "FAILED", type(e).__name__, str(e)[:500])
print(tactix.get_registry().get("cudnn").tactics(w.problem)[:5])
# LSE diagnostics for decode
w = tactix.PagedDecode("HND", backend="cudnn")
lens = [37, 100, 16, 300]
pages = [-(-n // 16) for n in lens]
total = sum(pages)
indptr = [0]
idx = list(range(total))
for n in pages:
    indptr.append(indptr[-1] + n)
last = [(n - 1) % 16 + 1 for n in lens]
k = torch.randn(total, 8, 16, 128).cuda().bfloat16()
v = torch.randn(total, 8, 16, 128).cuda().bfloat16()
q = torch.randn(4, 32, 128).cuda().bfloat16()
w.plan(i32(*indptr), i32(*idx), i32(*last), 32, 8, 128, 16, q_data_type=torch.bfloat16, return_lse=True)
lse = torch.full((4, 32), float("nan"), device="cuda")
out, lse = w.run(q, (k, v), lse=lse)
ref, rl = attention_reference(
    q,
    k,
    v,
    i32(0, 1, 2, 3, 4),
    i32(*indptr),
    i32(*idx),
    i32(*last),
    kv_layout="HND",
    causal=False,
    sm_scale=1 / math.sqrt(128),
)
torch.set_printoptions(precision=3, linewidth=200)
print("lse", lse[:, :6])
print("ref", rl[:, :6])
print("nan", torch.isnan(lse).sum().item())
print("flat lse", lse.flatten()[:12])
for t in tactix.get_registry().get("cudnn").tactics(w.problem)[1:]:
    w.plan(i32(*indptr), i32(*idx), i32(*last), 32, 8, 128, 16, q_data_type=torch.bfloat16, return_lse=True, tactic=t)
    lse.fill_(float("nan"))
    out, lse = w.run(q, (k, v), lse=lse)
    print(t, relative_error(out, ref), (lse.double() - rl).abs().max().item())
