"""The Triton kernels of the ops, one program per row, each the twin of the torch
reference beside its wrapper (saguaro_sampling.py, fork.py, cache_lookup.py say what
they compute). Imported only on first use (backend.kernels()): Triton is not needed on CPU.

Keys and ranks are ops/keys.py's, spelled out here: a rank is key * 2^32 + (2^32 - 1 - i),
the hash folds the seed's halves and mixes twice with 0x45D9F3B (= 73244475).
"""
import triton
import triton.language as tl

BIG = tl.constexpr(9223372036854775807)  # int64 max: above every rank
NONE = tl.constexpr(-(1 << 40))  # below every key: a lane past the row


@triton.jit
def _row_key(x):
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0: the key of +0.0
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _rank(key, offs):
    return key * 4294967296 + (4294967295 - offs.to(tl.int64))


@triton.jit
def _chunk(base, start, offs0, V):
    """Lanes start.. of a row: their offsets, which are inside it, the logits (fp32)."""
    offs = start + offs0
    valid = offs < V
    return offs, valid, tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32)


@triton.jit
def _weight(x, temp, zmax):
    """exp(z - max z), z = logit / temperature, in float64 (saguaro_sampling.py: why)."""
    return tl.exp(x.to(tl.float64) / temp - zmax)


@triton.jit
def _kept(x, offs, valid, thr, temp, zmax):
    """The lanes' weights, 0 outside the row and below the top-k / top-p cut; their ranks."""
    key = _row_key(x)
    return tl.where(valid & (key >= thr), _weight(x, temp, zmax), 0.0), _rank(key, offs)


@triton.jit
def saguaro_sample_kernel(logits_ptr, stride, temp_ptr, topk_ptr, topp_ptr, fan_ptr, seed_ptr,
                          tok_ptr, q_ptr, steps_ptr, V, C: tl.constexpr, Q: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row * stride
    out = q_ptr + row * V
    scratch = steps_ptr + row * V
    temp = tl.load(temp_ptr + row).to(tl.float64)
    k = tl.load(topk_ptr + row).to(tl.int64)
    top_p = tl.load(topp_ptr + row).to(tl.float64)
    fan = tl.load(fan_ptr + row).to(tl.int64)
    offs0 = tl.arange(0, BLOCK)

    # max logit and the row's key range
    zmax = tl.full((), float("-inf"), tl.float64)
    kmin = tl.full((), 1 << 40, tl.int64)
    kmax = tl.full((), NONE, tl.int64)
    for start in range(0, V, BLOCK):
        offs, valid, x = _chunk(base, start, offs0, V)
        key = tl.where(valid, _row_key(x), NONE)
        zmax = tl.maximum(zmax, tl.max(x.to(tl.float64), 0) / temp)
        kmin = tl.minimum(kmin, tl.min(tl.where(valid, key, 1 << 40), 0))
        kmax = tl.maximum(kmax, tl.max(key, 0))

    # top-k: the largest t with #(key >= t) >= k, by bisection over the integer keys
    thr = kmin
    if (k > 0) & (k < V):
        lo = kmin
        hi = kmax
        for _ in range(33):
            mid = lo + (hi - lo + 1) // 2
            n = tl.zeros((), tl.int64)
            for start in range(0, V, BLOCK):
                offs, valid, x = _chunk(base, start, offs0, V)
                key = tl.where(valid, _row_key(x), NONE)
                n += tl.sum((key >= mid).to(tl.int64), 0)
            ok = n >= k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        thr = lo

    # top-p: the smallest t with mass(key > t) < top_p, again by bisection
    if top_p < 1.0:
        s = tl.zeros((), tl.float64)
        for start in range(0, V, BLOCK):
            offs, valid, x = _chunk(base, start, offs0, V)
            key = tl.where(valid, _row_key(x), NONE)
            e = _weight(x, temp, zmax)
            s += tl.sum(tl.where(valid & (key >= thr), e, 0.0), 0)
        lo = thr
        hi = kmax
        for _ in range(33):
            mid = lo + (hi - lo) // 2
            m = tl.zeros((), tl.float64)
            for start in range(0, V, BLOCK):
                offs, valid, x = _chunk(base, start, offs0, V)
                key = tl.where(valid, _row_key(x), NONE)
                e = _weight(x, temp, zmax)
                m += tl.sum(tl.where(valid & (key >= thr) & (key > mid), e, 0.0), 0)
            ok = m / s < top_p
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid + 1)
        thr = lo

    # sigma_{F,C}: the (F+1)-th largest rank, one max pass per place
    nth = tl.full((), -BIG, tl.int64)
    if C < 1.0:
        prev = tl.full((), BIG, tl.int64)
        for _ in range(fan + 1):
            best = tl.full((), -BIG, tl.int64)
            for start in range(0, V, BLOCK):
                offs, valid, x = _chunk(base, start, offs0, V)
                rank = _rank(_row_key(x), offs)
                rank = tl.where(valid & (rank < prev), rank, -BIG)
                best = tl.maximum(best, tl.max(rank, 0))
            prev = best
        nth = prev

    # the kept mass, plain and scaled
    s = tl.zeros((), tl.float64)
    sig = tl.zeros((), tl.float64)
    for start in range(0, V, BLOCK):
        offs, valid, x = _chunk(base, start, offs0, V)
        e, rank = _kept(x, offs, valid, thr, temp, zmax)
        s += tl.sum(e, 0)
        sig += tl.sum(tl.where(rank >= nth, e * C, e), 0)
    top_scale = tl.where(sig > 0.0, C, 1.0)  # C = 0 with all the mass on top: unscaled
    norm = tl.where(sig > 0.0, sig, s)

    # counts: the steps of round(cumsum(q) * Q), and the draw r
    h = tl.load(seed_ptr + row).to(tl.int64)
    h = (h ^ (h >> 32)) & 4294967295
    h = (((h >> 16) ^ h) * 73244475) & 4294967295
    h = (((h >> 16) ^ h) * 73244475) & 4294967295
    r = ((h >> 16) ^ h) & (Q - 1)
    carry = tl.zeros((), tl.float64)
    token = tl.zeros((), tl.int64)
    for start in range(0, V, BLOCK):
        offs, valid, x = _chunk(base, start, offs0, V)
        e, rank = _kept(x, offs, valid, thr, temp, zmax)
        e = tl.where(rank >= nth, e * top_scale, e)
        cum = carry + tl.cumsum(e / norm, 0)
        carry = tl.max(tl.where(valid, cum, 0.0), 0)
        steps = tl.minimum(tl.floor(cum * Q + 0.5), Q * 1.0)
        steps = tl.where(offs == V - 1, Q * 1.0, steps).to(tl.int32)
        tl.store(scratch + offs, steps, mask=valid)
        token += tl.sum((valid & (steps <= r)).to(tl.int64), 0)
    tl.store(tok_ptr + row, token)
    tl.debug_barrier()
    for start in range(0, V, BLOCK):
        offs = start + offs0
        valid = offs < V
        cur = tl.load(scratch + offs, mask=valid, other=0)
        prv = tl.load(scratch + offs - 1, mask=valid & (offs > 0), other=0)
        tl.store(out + offs, (cur - prv).to(tl.float32) / Q, mask=valid)


@triton.jit
def fork_kernel(logits_ptr, stride, drafted_ptr, fan_ptr, out_ptr, V,
                WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row * stride
    drafted = tl.load(drafted_ptr + row).to(tl.int64)
    fan = tl.load(fan_ptr + row).to(tl.int64)
    offs0 = tl.arange(0, BLOCK)
    prev = tl.full((), BIG, tl.int64)
    for j in range(WIDTH):
        best = tl.full((), -BIG, tl.int64)
        for start in range(0, V, BLOCK):
            offs, valid, x = _chunk(base, start, offs0, V)
            rank = _rank(_row_key(x), offs)
            ok = valid & (offs != drafted) & (x != float("-inf")) & (rank < prev)
            best = tl.maximum(best, tl.max(tl.where(ok, rank, -BIG), 0))
        found = (best > -BIG) & (j < fan)
        idx = 4294967295 - (best & 4294967295)
        tl.store(out_ptr + row * WIDTH + j, tl.where(found, idx, -1))
        prev = best


@triton.jit
def cache_lookup_kernel(keys_ptr, query_ptr, out_ptr, N, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(query_ptr + b * 3)
    k = tl.load(query_ptr + b * 3 + 1)
    tok = tl.load(query_ptr + b * 3 + 2)
    offs0 = tl.arange(0, BLOCK)
    first = tl.full((), BIG, tl.int64)
    for start in range(0, N, BLOCK):
        offs = start + offs0
        valid = offs < N
        kr = tl.load(keys_ptr + offs * 3, mask=valid, other=-1)
        kk = tl.load(keys_ptr + offs * 3 + 1, mask=valid, other=-1)
        kt = tl.load(keys_ptr + offs * 3 + 2, mask=valid, other=-1)
        hit = valid & (kr == row) & (kk == k) & (kt == tok)
        first = tl.minimum(first, tl.min(tl.where(hit, offs.to(tl.int64),
                                                   BIG), 0))
    tl.store(out_ptr + b, tl.where(first < N, first, -1))
