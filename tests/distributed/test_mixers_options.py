"""ringattn.mixers agree on the whole call: every public function's every option by its
value (a tensor option, such as a 0-d ``scale``, a ``dt_limit`` of tensors or ``A``, by its
shape, values and requires_grad; a shard by its identity: dtype, shape but the sequence
dim, requires_grad, None or not), so ranks that differ in one raise the same ValueError
naming it, on every rank, before any exchange; an argument given positionally or by
keyword, or left at its default, is the same argument, and so are equal values spelled
otherwise (1 and 1.0, a 0-d tensor and its number, the same values in another dtype, NaN
and NaN), which give the one result. And a rank with no token (S < W, a shard of padding only)
gets zero gradients for every tensor argument that requires grad, never None: outputs and
gradients equal a float64 loop in one process on every rank, and the parameters' shares
sum to the one-process gradient. Three gloo ranks, started once for the module."""

import math
from functools import partial

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
from ringattn import mixers
from ringattn.mixers.families import _gdn_scan, _ssd_scan
from ringattn.testing import count_collectives
from test_mixers import _err, ref_conv, ref_diag, ref_gdn, ref_ssd
from test_mixers_rnn import ref_mlstm, ref_wkv

WORLD = 3


# ------------------------------------------------------------ kernels (module level: named
# alike on every rank)

def gdn_kernel(q, k, v, g, beta, *, initial_state=None, output_final_state=True,
               use_qk_l2norm_in_kernel=False, chunk_size=4):
    return _gdn_scan(q, k, v, g, beta, initial_state, 1.0 / math.sqrt(k.shape[-1]))


def other_gdn_kernel(q, k, v, g, beta, **kw):
    return gdn_kernel(q, k, v, g, beta, **kw)


def ssd_kernel(x, dt, A, B, C, *, D=None, initial_states=None, return_final_states=True,
               chunk_size=4):
    return _ssd_scan(x, dt, B, C, A, D, initial_states)


def wkv_kernel(time_decay, time_first, key, value, state=None, return_state=True):
    raise AssertionError("not reached: the agreement refuses first")


def mlstm_kernel(**kw):
    raise AssertionError("not reached: the agreement refuses first")


def _raises(fn):
    """(exception type name, message, collectives made) of a call that should raise."""
    with count_collectives() as calls:
        try:
            fn()
        except (TypeError, ValueError) as exc:
            return type(exc).__name__, str(exc), sorted({name for name, _ in calls})
    return None, "no error", sorted({name for name, _ in calls})


def _inputs(seqlen, seed=0, kw=None):
    """This rank's shards (float64) of every family's inputs, and replicated parameters."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    kw = kw or dict(layout="zigzag", seqlen=seqlen)
    sh = lambda t: ra.shard(t, **kw)  # noqa: E731
    b = 1
    t = dict(
        x=sh(rnd(b, seqlen, 3)), w=rnd(3, 4), bias=rnd(3),
        a=sh(torch.sigmoid(rnd(b, seqlen, 3))),
        q=sh(rnd(b, seqlen, 1, 3)), k=sh(rnd(b, seqlen, 1, 3)), v=sh(rnd(b, seqlen, 2, 2)),
        g=sh(-rnd(b, seqlen, 2).abs()), gk=sh(-rnd(b, seqlen, 2, 3).abs()),
        beta=sh(torch.sigmoid(rnd(b, seqlen, 2))),
        hs=sh(rnd(b, seqlen, 2, 2)), dt=sh(rnd(b, seqlen, 2)), B=sh(rnd(b, seqlen, 1, 3)),
        C=sh(rnd(b, seqlen, 1, 3)), A=-rnd(2).abs() - 0.2, D=rnd(2), dt_bias=rnd(2),
        td=rnd(3), tf=rnd(3), key=sh(rnd(b, seqlen, 3)), value=sh(rnd(b, seqlen, 3)),
        mq=sh(rnd(b, seqlen, 2, 3)), mk=sh(rnd(b, seqlen, 2, 3)), mv=sh(rnd(b, seqlen, 2, 2)),
        ig=sh(rnd(b, seqlen, 2)), fg=sh(rnd(b, seqlen, 2)))
    return t


def _decay_scan(p):
    """A linear_recurrence family with a replicated parameter p [F]: h_t = sigmoid(p) h + x_t."""
    def scan(piece, state):
        (x,) = piece
        h = state if state is not None else x.new_zeros((x.shape[0], x.shape[2]))
        out = []
        for t in range(x.shape[1]):
            h = torch.sigmoid(p) * h + x[:, t]
            out.append(h)
        return torch.stack(out, dim=1), h

    def transition(piece):
        return torch.sigmoid(p).expand(piece[0].shape[0], -1) ** piece[0].shape[1]

    return scan, transition


def other_transition(piece):
    return piece[0].sum(dim=1)


def option_cases():
    """Each case: one rank (the ``odd`` one) passes something else for one argument.
    Returns {case: (type, message, collectives made)} on this rank, and the results of
    the calls that must agree."""
    rank = dist.get_rank()
    s = 6
    kw = dict(layout="zigzag", seqlen=s)
    t = _inputs(s)
    said = {}

    def case(name, odd, fn):
        said[name] = _raises(lambda: fn(rank == odd))

    conv = mixers.causal_conv1d
    case("conv activation", 1, lambda o: conv(t["x"], t["w"], t["bias"],
                                              activation="silu" if o else None, **kw))
    case("conv bias None", 2, lambda o: conv(t["x"], t["w"], None if o else t["bias"], **kw))
    case("conv weight k", 0, lambda o: conv(t["x"], t["w"][:, :3] if o else t["w"], **kw))
    case("conv weight dtype", 1, lambda o: conv(t["x"], t["w"].float() if o else t["w"], **kw))
    case("conv weight grad", 2, lambda o: conv(
        t["x"].clone().requires_grad_(), t["w"].clone().requires_grad_(o), **kw))

    diag = mixers.diagonal_recurrence
    case("diag x dtype", 1, lambda o: diag(t["a"], t["x"].float() if o else t["x"], **kw))
    case("diag a grad", 0, lambda o: diag(t["a"].clone().requires_grad_(o),
                                          t["x"].clone().requires_grad_(), **kw))

    gdn = partial(mixers.gated_delta_rule, t["q"], t["k"], t["v"])
    case("gdn use_qk_l2norm", 1, lambda o: gdn(t["g"], t["beta"], use_qk_l2norm=o, **kw))
    case("gdn scale", 2, lambda o: gdn(t["g"], t["beta"], scale=0.5 if o else None, **kw))
    case("gdn scale last bit", 0, lambda o: gdn(
        t["g"], t["beta"], scale=math.nextafter(0.5, 1.0) if o else 0.5, **kw))
    case("gdn kernel", 1, lambda o: gdn(t["g"], t["beta"], kernel=gdn_kernel if o else None, **kw))
    case("gdn kernel name", 2, lambda o: gdn(
        t["g"], t["beta"], kernel=other_gdn_kernel if o else gdn_kernel, **kw))
    case("gdn kernel partial", 0, lambda o: gdn(
        t["g"], t["beta"], kernel=partial(gdn_kernel, chunk_size=8 if o else 4), **kw))
    case("gdn g per channel", 1, lambda o: gdn(t["gk"] if o else t["g"], t["beta"], **kw))

    ssd = partial(mixers.mamba2_ssd, t["hs"], t["dt"], t["A"], t["B"], t["C"])
    case("ssd D None", 2, lambda o: ssd(D=None if o else t["D"], **kw))
    case("ssd dt_bias None", 0, lambda o: ssd(dt_bias=t["dt_bias"] if o else None, **kw))
    case("ssd dt_softplus", 1, lambda o: ssd(dt_softplus=o, **kw))
    case("ssd dt_limit", 2, lambda o: ssd(dt_limit=(0.0, 0.5) if o else (0.0, math.inf), **kw))
    case("ssd dt_limit last bit", 0, lambda o: ssd(
        dt_limit=(math.nextafter(0.0, 1.0) if o else 0.0, math.inf), **kw))
    case("ssd kernel", 1, lambda o: ssd(kernel=partial(ssd_kernel) if o else None, **kw))
    case("ssd A dtype", 2, lambda o: mixers.mamba2_ssd(
        t["hs"], t["dt"], t["A"].float() if o else t["A"], t["B"], t["C"], **kw))

    wkv = partial(mixers.wkv, t["td"], t["tf"], t["key"], t["value"])
    case("wkv kernel", 0, lambda o: wkv(kernel=wkv_kernel if o else None, **kw))
    case("wkv time_first grad", 1, lambda o: mixers.wkv(
        t["td"].clone().requires_grad_(), t["tf"].clone().requires_grad_(o), t["key"],
        t["value"], **kw))

    ml = partial(mixers.mlstm, t["mq"], t["mk"], t["mv"], t["ig"], t["fg"])
    case("mlstm eps", 2, lambda o: ml(eps=1e-5 if o else 1e-6, **kw))
    case("mlstm eps last bit", 0, lambda o: ml(eps=math.nextafter(1e-6, 1.0) if o else 1e-6, **kw))
    case("mlstm kernel", 1, lambda o: ml(kernel=mlstm_kernel if o else None, **kw))

    p = torch.zeros(3, dtype=torch.float64)
    scan, transition = _decay_scan(p)
    rec = partial(mixers.linear_recurrence, scan, inputs=(t["x"],), state_shape=(1, 3),
                  map_shape=(1, 3), out_shape=(3,), **kw)
    case("lr transition", 2, lambda o: rec(other_transition if o else transition))
    case("lr kind", 0, lambda o: rec(transition, kind="matrix" if o else "diagonal"))
    case("lr state_dtype", 1, lambda o: rec(transition, state_dtype=torch.float32 if o else None))
    case("lr params", 2, lambda o: rec(transition, params=() if o else (p,)))
    case("lr out_shape", 0, lambda o: rec(transition, out_shape=(1, 3) if o else (3,)))

    # an option is compared by its value, a tensor option too (not its dtype, shape and
    # requires_grad only: two ranks with other 0-d scales once mixed silently)
    t0 = torch.tensor
    case("gdn scale 0-d tensors", 1, lambda o: gdn(
        t["g"], t["beta"], scale=t0(0.25 if o else 0.5), **kw))
    case("gdn scale NaN", 2, lambda o: gdn(t["g"], t["beta"], scale=math.nan if o else 0.5, **kw))
    case("gdn scale requires grad", 0, lambda o: gdn(
        t["g"], t["beta"], scale=t0(0.5, dtype=torch.float64).requires_grad_(o), **kw))
    case("gdn use_qk_l2norm 1 for True", 1, lambda o: gdn(
        t["g"], t["beta"], use_qk_l2norm=1 if o else True, **kw))  # a flag is not a count
    case("ssd dt_limit 0-d tensors", 2, lambda o: ssd(
        dt_limit=(t0(0.0), t0(0.25 if o else 0.5)), **kw))
    case("ssd dt_limit a tensor", 0, lambda o: ssd(dt_limit=t0([0.0, 0.5 if o else math.inf]), **kw))
    case("ssd dt_limit -inf", 1, lambda o: ssd(dt_limit=(-math.inf if o else 0.0, math.inf), **kw))
    case("ssd dt_limit 0.1 in float32", 2, lambda o: ssd(  # float32's 0.1 is another number
        dt_limit=(t0(0.1) if o else 0.1, math.inf), **kw))
    case("ssd A values", 0, lambda o: mixers.mamba2_ssd(
        t["hs"], t["dt"], t["A"] - 0.1 if o else t["A"], t["B"], t["C"], **kw))
    case("ssd dt_bias one value", 1, lambda o: ssd(
        dt_bias=t["dt_bias"] + torch.tensor([0.0, 1e-9 if o else 0.0], dtype=torch.float64),
        **kw))
    case("conv weight values", 2, lambda o: conv(t["x"], t["w"] * 2 if o else t["w"], **kw))
    case("wkv time_decay values", 0, lambda o: mixers.wkv(
        -t["td"] if o else t["td"], t["tf"], t["key"], t["value"], **kw))
    case("mlstm eps 0-d tensor", 1, lambda o: ml(
        eps=t0(1e-5 if o else 1e-6, dtype=torch.float64), **kw))
    case("lr params values", 2, lambda o: rec(transition, params=(p + 1,) if o else (p,)))

    # one step to the side: the same call, spelled differently on one rank, agrees (one
    # line makes each call: the agreement compares the caller's line too)
    same = {}
    o = rank == 1

    def spelled(fn, usual, other):
        args, kwargs = other if o else usual
        return fn(*args, **kwargs)

    def check(name, fn, usual, other):
        ref = spelled(fn, usual, usual)
        same[name] = _err(spelled(fn, usual, other), ref)

    x, w, bias = t["x"], t["w"], t["bias"]
    check("conv bias by keyword", conv, ((x, w, bias), dict(activation="silu", **kw)),
          ((x, w), dict(bias=bias, activation="silu", **kw)))
    g_, beta = t["g"], t["beta"]
    check("gdn defaults explicit", gdn, ((g_, beta), kw),
          ((g_, beta), dict(use_qk_l2norm=False, scale=None, kernel=None, **kw)))
    same["gdn a partial made on each rank"] = _err(
        gdn(g_, beta, kernel=partial(gdn_kernel, chunk_size=4), **kw), gdn(g_, beta, **kw))
    check("gdn the kernel by keyword, every rank its own partial", gdn,
          ((g_, beta), dict(kernel=partial(gdn_kernel, chunk_size=4), **kw)),
          ((), dict(g=g_, beta=beta, kernel=partial(gdn_kernel, chunk_size=4), **kw)))
    check("ssd dt_limit as a list, explicit", ssd, ((), dict(D=t["D"], **kw)),
          ((), dict(D=t["D"], dt_limit=[0.0, math.inf], dt_softplus=False, **kw)))
    check("mlstm eps explicit", ml, ((), kw), ((), dict(eps=1e-6, **kw)))

    # equal values in another spelling agree (1 and 1.0, a 0-d tensor and its number, the
    # same values in another dtype, -0.0 and 0.0, -inf and NaN as tensors or floats) and give
    # the one result
    one = torch.tensor(1.0)
    check("gdn scale 1 and 1.0", gdn, ((g_, beta), dict(scale=1.0, **kw)),
          ((g_, beta), dict(scale=1, **kw)))
    check("gdn scale a 0-d tensor and its float", gdn, ((g_, beta), dict(scale=0.5, **kw)),
          ((g_, beta), dict(scale=torch.tensor(0.5), **kw)))
    check("gdn scale 0-d tensors of two dtypes", gdn,
          ((g_, beta), dict(scale=torch.tensor(0.375, dtype=torch.float64), **kw)),
          ((g_, beta), dict(scale=torch.tensor(0.375, dtype=torch.float16), **kw)))
    check("ssd dt_limit 0-d tensors and floats", ssd, ((), dict(dt_limit=(0.0, 0.5), **kw)),
          ((), dict(dt_limit=(torch.tensor(0.0), torch.tensor(0.5)), **kw)))
    check("ssd dt_limit ints and floats", ssd, ((), dict(dt_limit=(0.0, 1.0), **kw)),
          ((), dict(dt_limit=(0, one), **kw)))
    check("ssd dt_limit a tensor in two dtypes", ssd,
          ((), dict(dt_limit=torch.tensor([0.0, 0.5], dtype=torch.float64), **kw)),
          ((), dict(dt_limit=torch.tensor([0.0, 0.5], dtype=torch.bfloat16), **kw)))
    check("ssd dt_limit -inf, a float and a tensor", ssd,
          ((), dict(dt_limit=(-math.inf, math.inf), **kw)),
          ((), dict(dt_limit=(torch.tensor(-math.inf), math.inf), **kw)))
    check("ssd dt_limit -0.0 and 0.0", ssd, ((), dict(dt_limit=(0.0, math.inf), **kw)),
          ((), dict(dt_limit=(-0.0, math.inf), **kw)))
    a32 = t["A"].float()  # values a float32 holds exactly: the same A in either dtype
    check("ssd A in float32 and float64, equal values", mixers.mamba2_ssd,
          ((t["hs"], t["dt"], a32.double(), t["B"], t["C"]), kw),
          ((t["hs"], t["dt"], a32, t["B"], t["C"]), kw))
    check("mlstm eps a 0-d tensor", ml, ((), dict(eps=1e-6, **kw)),
          ((), dict(eps=torch.tensor(1e-6, dtype=torch.float64), **kw)))
    check("lr params of two dtypes", rec, ((transition,), dict(params=(p,))),
          ((transition,), dict(params=(p.float(),))))
    # NaN agrees with NaN (the one NaN call on every rank, not a refusal, not a hang)
    nan_ref = spelled(gdn, ((g_, beta), dict(scale=math.nan, **kw)),
                      ((g_, beta), dict(scale=math.nan, **kw)))
    nan_got = spelled(gdn, ((g_, beta), dict(scale=math.nan, **kw)),
                      ((g_, beta), dict(scale=torch.tensor(float("nan")), **kw)))
    same["gdn scale NaN, a float and a tensor"] = 0.0 if bool(
        torch.equal(nan_got.isnan(), nan_ref.isnan())
        and torch.equal(nan_got.nan_to_num(), nan_ref.nan_to_num())) else math.inf
    check("mlstm keywords, seqlen implied", mixers.mlstm,
          ((t["mq"], t["mk"], t["mv"], t["ig"], t["fg"]), kw),
          ((), dict(query=t["mq"], key=t["mk"], value=t["mv"], igate=t["ig"], fgate=t["fg"],
                    layout="zigzag", seqlen=None)))
    return said, same


_EXPECT = {  # case -> the argument its message names
    "conv activation": "activation", "conv bias None": "bias", "conv weight k": "weight",
    "conv weight dtype": "weight", "conv weight grad": "weight", "diag x dtype": "x",
    "diag a grad": "a", "gdn use_qk_l2norm": "use_qk_l2norm", "gdn scale": "scale",
    "gdn scale last bit": "scale", "gdn kernel": "kernel", "gdn kernel name": "kernel",
    "gdn kernel partial": "kernel", "gdn g per channel": "g", "ssd D None": "D",
    "ssd dt_bias None": "dt_bias", "ssd dt_softplus": "dt_softplus",
    "ssd dt_limit": "dt_limit", "ssd dt_limit last bit": "dt_limit", "ssd kernel": "kernel",
    "ssd A dtype": "A", "wkv kernel": "kernel", "wkv time_first grad": "time_first",
    "mlstm eps": "eps", "mlstm eps last bit": "eps", "mlstm kernel": "kernel",
    "lr transition": "transition", "lr kind": "kind", "lr state_dtype": "state_dtype",
    "lr params": "params", "lr out_shape": "out_shape",
    "gdn scale 0-d tensors": "scale", "gdn scale NaN": "scale",
    "gdn scale requires grad": "scale", "gdn use_qk_l2norm 1 for True": "use_qk_l2norm",
    "ssd dt_limit 0-d tensors": "dt_limit", "ssd dt_limit a tensor": "dt_limit",
    "ssd dt_limit -inf": "dt_limit", "ssd dt_limit 0.1 in float32": "dt_limit",
    "ssd A values": "A", "ssd dt_bias one value": "dt_bias", "conv weight values": "weight",
    "wkv time_decay values": "time_decay", "mlstm eps 0-d tensor": "eps",
    "lr params values": "params",
}


@pytest.mark.timeout(120)
def test_every_argument_is_agreed(clusters):
    results = clusters(WORLD).run(option_cases, timeout=90)
    for rank, (said, same) in enumerate(results):
        assert set(said) == set(_EXPECT), sorted(set(said) ^ set(_EXPECT))
        for case, arg in _EXPECT.items():
            kind, msg, calls = said[case]
            assert kind == "ValueError" and msg.startswith(f"ranks disagree on {arg}: "), \
                (rank, case, kind, msg)
            assert msg == results[0][0][case][1], (rank, case, msg)  # the same on every rank
            assert calls == ["agreement"], (rank, case, calls)  # before any exchange
        for case, err in same.items():
            assert err < 1e-12, (rank, case, err)
    said = results[0][0]
    # what each rank passed, in words
    assert "rank 1 has True" in said["gdn use_qk_l2norm"][1], said["gdn use_qk_l2norm"]
    assert "False" in said["gdn use_qk_l2norm"][1], said["gdn use_qk_l2norm"]
    assert "rank 2 has 0.5" in said["gdn scale"][1] and "None" in said["gdn scale"][1]
    assert "0.5000000000000001" in said["gdn scale last bit"][1], said["gdn scale last bit"]
    assert "rank 2 has None" in said["ssd D None"][1] and "a 1-d tensor (values digest" in \
        said["ssd D None"][1], said["ssd D None"]
    for case, *words in (
            ("gdn scale 0-d tensors", "rank 1 has 0.25", "ranks 0, 2 have 0.5"),
            ("gdn scale NaN", "rank 2 has nan", "ranks 0, 1 have 0.5"),
            ("gdn scale requires grad", "rank 0 has a 0-d tensor requiring grad",
             "ranks 1, 2 have 0.5"),
            ("gdn use_qk_l2norm 1 for True", "rank 1 has 1", "ranks 0, 2 have True"),
            ("ssd dt_limit 0.1 in float32", "rank 2 has a sequence of 2 items"),
            ("mlstm eps 0-d tensor", "rank 1 has 1e-05", "ranks 0, 2 have 1e-06")):
        assert all(w in said[case][1] for w in words), (case, said[case])
    assert "'silu'" in said["conv activation"][1], said["conv activation"]
    assert "1e-05" in said["mlstm eps"][1] and "1e-06" in said["mlstm eps"][1]
    assert "torch.float32 tensor [1, S_local, 3]" in said["diag x dtype"][1], said["diag x dtype"]
    assert "requiring grad" in said["wkv time_first grad"][1], said["wkv time_first grad"]
    assert "'matrix'" in said["lr kind"][1] and "'diagonal'" in said["lr kind"][1]


def test_every_public_function_is_agreed():
    for name in mixers.__all__:
        assert getattr(getattr(mixers, name), "__ringattn_agreed__", False), name


# ------------------------------------------------------------ ranks with no token

_CU = [0, 1, 2]


def _families(seqlen, cu, g):
    """For each family: (global inputs, replicated parameters, run(sharded, params, kw),
    reference(inputs, params))."""
    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    b, s = 2, seqlen
    pos = lambda t: -t.abs() - 0.2  # noqa: E731
    fams = {
        "conv": ({"x": rnd(b, s, 3)}, {"w": rnd(3, 4), "bias": rnd(3)},
                 lambda x, p, kw: mixers.causal_conv1d(x["x"], p["w"], p["bias"],
                                                       activation="silu", **kw),
                 lambda x, p: ref_conv(x["x"], p["w"], p["bias"], True, cu)),
        "diag": ({"a": torch.sigmoid(rnd(b, s, 3)), "x": rnd(b, s, 3)}, {},
                 lambda x, p, kw: mixers.diagonal_recurrence(x["a"], x["x"], **kw),
                 lambda x, p: ref_diag(x["a"], x["x"], cu)),
        "gdn": ({"q": rnd(b, s, 1, 3), "k": rnd(b, s, 1, 3), "v": rnd(b, s, 2, 2),
                 "g": -rnd(b, s, 2, scale=0.3).abs(), "beta": torch.sigmoid(rnd(b, s, 2))}, {},
                lambda x, p, kw: mixers.gated_delta_rule(x["q"], x["k"], x["v"], x["g"],
                                                         x["beta"], use_qk_l2norm=True, **kw),
                lambda x, p: ref_gdn(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                     1 / math.sqrt(3), True, cu)),
        "ssd": ({"x": rnd(b, s, 2, 2), "dt": rnd(b, s, 2), "B": rnd(b, s, 1, 3),
                 "C": rnd(b, s, 1, 3)}, {"A": pos(rnd(2)), "D": rnd(2), "dt_bias": rnd(2)},
                lambda x, p, kw: mixers.mamba2_ssd(x["x"], x["dt"], p["A"], x["B"], x["C"],
                                                   D=p["D"], dt_bias=p["dt_bias"],
                                                   dt_softplus=True, **kw),
                lambda x, p: ref_ssd(x["x"], x["dt"], p["A"], x["B"], x["C"], p["D"],
                                     p["dt_bias"], cu)),
        "wkv": ({"k": rnd(b, s, 3), "v": rnd(b, s, 3)}, {"td": rnd(3), "tf": rnd(3)},
                lambda x, p, kw: mixers.wkv(p["td"], p["tf"], x["k"], x["v"], **kw),
                lambda x, p: ref_wkv(p["td"], p["tf"], x["k"], x["v"], cu)),
        "mlstm": ({"q": rnd(b, s, 2, 3), "k": rnd(b, s, 2, 3), "v": rnd(b, s, 2, 2),
                   "i": rnd(b, s, 2) - 2.0, "f": rnd(b, s, 2)}, {},
                  lambda x, p, kw: mixers.mlstm(x["q"], x["k"], x["v"], x["i"], x["f"],
                                                eps=1e-2, **kw),
                  lambda x, p: ref_mlstm(x["q"], x["k"], x["v"], x["i"], x["f"], 1e-2, cu)),
        "lr": ({"x": rnd(b, s, 3)}, {"p": rnd(3)}, _run_lr, _ref_lr),
    }
    return fams


def _run_lr(x, p, kw):
    scan, transition = _decay_scan(p["p"])
    return mixers.linear_recurrence(scan, transition, (x["x"],), state_shape=(2, 3),
                                    map_shape=(2, 3), out_shape=(3,), params=(p["p"],),
                                    name="decayed scan", **kw)


def _ref_lr(x, p):
    return ref_diag(torch.sigmoid(p["p"]).expand_as(x["x"]), x["x"], None)


def _grad(t):
    return t.grad if t.grad is not None else torch.zeros_like(t)  # None: no path, zero


def _rel(got, want, whole):
    """Largest difference over the largest entry of the whole one-process gradient, at
    least 1e-3 (a gradient that is analytically zero, RWKV's d out / d k of a document's
    only token, is rounding noise of about 1e-16)."""
    return float((got - want).abs().max() / whole.abs().max().clamp(min=1e-3))


def empty_rank_cases():
    """Every public function where some rank holds no real token: zigzag S=1 and S=2,
    contiguous S=2, and per-document zigzag with two documents of one token. This rank's
    local shards are the leaves, as are the parameters. Returns per case: (holds a token,
    worst error of output and gradients, gradients that were None, largest |share| of a
    parameter's gradient)."""
    shapes = [("zigzag", 1, None), ("zigzag", 2, None), ("contiguous", 2, None),
              ("zigzag", 2, _CU)]
    out = {}
    for i, (layout, seqlen, cu) in enumerate(shapes):
        kw = dict(layout=layout, seqlen=seqlen, cu_seqlens=cu)
        real = ra.positions(seqlen, layout=layout, cu_seqlens=cu)
        holds = bool(((real[0] if cu is not None else real) < seqlen).any())
        fams = _families(seqlen, cu, torch.Generator().manual_seed(i))
        for fam, (glob, par, run, reference) in fams.items():
            if fam == "lr" and cu is not None:
                continue  # (its reference ignores documents)
            local = {n: ra.shard(t, **kw).detach().requires_grad_() for n, t in glob.items()}
            mine = {n: t.clone().requires_grad_() for n, t in par.items()}
            y = run(local, mine, kw)
            full = ra.unshard(y, **kw)
            weight = torch.randn(full.shape, generator=torch.Generator().manual_seed(7),
                                 dtype=torch.float64)
            (full * weight).sum().backward()
            ref_in = {n: t.clone().requires_grad_() for n, t in glob.items()}
            ref_par = {n: t.clone().requires_grad_() for n, t in par.items()}
            want = reference(ref_in, ref_par)
            (want * weight).sum().backward()
            none = [n for n, t in {**local, **mine}.items() if t.grad is None]
            errs = [_err(full, want)]
            for n, t in local.items():  # this rank's slots of the one-process gradient
                if t.grad is not None:
                    errs.append(_rel(t.grad, ra.shard(_grad(ref_in[n]), **kw), _grad(ref_in[n])))
            share = 0.0
            for n, t in mine.items():
                if t.grad is None:
                    continue
                share = max(share, float(t.grad.abs().max()))
                total = t.grad.clone()
                dist.all_reduce(total)  # one collective per parameter on every rank
                errs.append(_rel(total, _grad(ref_par[n]), _grad(ref_par[n])))
            out[(fam, layout, seqlen, cu is not None)] = (holds, max(errs), none, share)
    return out


@pytest.mark.timeout(120)
def test_ranks_without_tokens_get_zero_gradients(clusters):
    results = clusters(WORLD).run(empty_rank_cases, timeout=90)
    empty_seen = 0
    for rank, cases in enumerate(results):
        assert len(cases) == 7 * 3 + 6, len(cases)
        for case, (holds, err, none, share) in cases.items():
            assert not none, (rank, case, "gradients left None", none)
            assert err < 1e-10, (rank, case, err)
            if not holds:  # its own share of every parameter's gradient is zero
                empty_seen += 1
                assert share == 0.0, (rank, case, share)
    assert empty_seen >= 4 * 6, empty_seen
