"""Decoding algorithms for sequence completion: greedy, ancestral sampling (with temperature),
top-k, nucleus (top-p) and beam search, batched over prompts and cached.

Papers and equations (NMST paper: Choi et al., "A Non-monotonic Self-terminating Language Model",
ICLR 2023):
  * greedy search                         eq. 8
  * top-k sampling                        eq. 12-13 (Definition A.1, Fan et al. 2018)
  * nucleus sampling                      eq. 14-15 (Definition A.2, Holtzman et al. 2020)
  * beam search                           eq. 16-19 (Definition A.3, Welleck et al. 2020)
  * the non-termination ratio r_nt(L)     eq. 11: r_nt(L) = q(|y| > L)
  * "consistent" top-k / nucleus          Welleck et al. 2020: eos is always kept in V_t

Every decoder works with every backbone and every head: one decoding step is one incremental
forward through the model's state (RNN/LSTM hidden state, GPT key/value cache, ST running
log_keep), never a re-encoding of the prefix.  Beam search re-ranks hypotheses by reordering
*all* of that state with LanguageModel.reorder_state (the reference NMST code forgets the LSTM
and ST state there).  Finished prompts are dropped from the batch as they finish.

Continuation step t: t = 1 for the first generated token (NMST eq. 10), so the prompt's last
position is scored with t = 1 and a prompt of length n starts at t = 2 - n.

A decode returns, per prompt, the continuation tokens (eos included when it was produced) and
whether it terminated within L tokens.  A continuation that has not produced eos after L
tokens is cut there: |y| > L, it counts as non-terminated in r_nt(L).
"""

import math

import torch
from tqdm import tqdm

from common import INT1, POS, SEED, UserError, number
from model import WINDOWED, eval_mode

DECODERS = ("greedy", "sample", "topk", "nucleus", "beam")
SAMPLING = ("sample", "topk", "nucleus")  # the decoders that draw (greedy and beam do not)


# --- candidate sets V_t (eq. 13, eq. 15) as boolean masks over the vocabulary -----------------
def topk_mask(log_probs, k):
    """eq. 13: V_t = arg top-k p(y_t = v).  log_probs (N, V) -> bool (N, V) with exactly
    min(k, V) True per row (ties at the boundary broken by torch.topk; any choice satisfies
    eq. 6)."""
    k = min(int(k), log_probs.size(-1))
    idx = torch.topk(log_probs, k, dim=-1).indices
    return torch.zeros_like(log_probs, dtype=torch.bool).scatter_(-1, idx, True)


def nucleus_mask(log_probs, p):
    """eq. 15: V_t = the smallest set of most probable tokens whose total probability >= p.
    A token is kept when the mass of the tokens ranked before it is < p (up to 1e-6 of float
    rounding), so the top token is always kept; p = 1 keeps the whole support (every token of
    non-zero probability), however the masses round.  log_probs (N, V) -> bool (N, V)."""
    if p >= 1.0:
        return log_probs > float("-inf")
    sorted_lp, order = torch.sort(log_probs, dim=-1, descending=True)
    cum = torch.cumsum(sorted_lp.double().exp(), dim=-1)
    mass_before = torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], dim=-1)
    keep_sorted = mass_before < p - 1e-6  # a mass within 1e-6 of p has reached it (rounding)
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def filter_log_probs(log_probs, decoder, k=None, p=None, temperature=1.0, always=None):
    """q(y_t = v) of eq. 12 / 14 (and plain sampling): temperature, then the candidate set,
    renormalised.  always: a token id kept in V_t whatever its probability (the consistent
    decoders keep eos).  -> log q (N, V), -inf outside V_t."""
    if temperature != 1.0:  # shifted first: (lp - max) / T lies in [-inf, 0] for any T > 0, so
        # a temperature too small for float (1e-39) leaves the argmax alone: greedy, no NaN
        lp = (log_probs - log_probs.amax(-1, keepdim=True)) / temperature
    else:
        lp = log_probs
    lp = lp - torch.logsumexp(lp, dim=-1, keepdim=True)
    if decoder == "sample":
        return lp
    if decoder == "topk":
        mask = topk_mask(lp, k)
    elif decoder == "nucleus":
        mask = nucleus_mask(lp, p)
    else:
        # A decoder without its branch is an error, never plain sampling under another name.
        names = ", ".join(SAMPLING)
        raise ValueError(f"filter_log_probs has no branch for the decoder {decoder!r} ({names})")
    if always is not None:
        mask[..., always] = True
    lp = lp.masked_fill(~mask, float("-inf"))
    return lp - torch.logsumexp(lp, dim=-1, keepdim=True)


# --- steppers: how the next-token distribution of every active row is obtained ----------------
class CachedStepper:
    """One incremental forward per step through the model's state (the real decoder)."""

    def __init__(self, lm):
        self.lm = lm

    def start(self, prompts, lengths):
        """prompts (N, P) right-padded, lengths (N,) -> log p(y_1 | x) (N, V)."""
        log_probs, self.state = self.lm.prompt(prompts, lengths)
        return log_probs

    def advance(self, tokens, t):
        """tokens (N,) just chosen at step t-1 -> log p(y_t | ...) (N, V)."""
        steps = torch.full((len(tokens), 1), t, dtype=torch.long, device=tokens.device)
        lp, self.state = self.lm.log_probs(tokens.unsqueeze(1), steps, state=self.state)
        return lp[:, 0]

    def reorder(self, index):
        self.state = self.lm.reorder_state(self.state, index)


# --- the decoders -----------------------------------------------------------------------------
@torch.no_grad()
def decode(lm, prompts, L, decoder="greedy", generator=None, **options):
    """Continue every prompt for at most L tokens.
    prompts: list of 1-D LongTensors (different lengths allowed), or an (N, P) tensor.
    options: the decoder's own, as check_decoder_args names them (k, p, beam_size, temperature,
    consistent, length_penalty).
    -> dict(tokens: list of lists (eos included when produced), terminated: bool tensor (N,),
            lengths: long tensor (N,) = len(tokens), scores: sum of log-probs (N,))."""
    options = dict(DECODER_OPTIONS, **options)
    check_decoder_args(decoder, **options)
    device = next(lm.parameters()).device
    padded, lengths = pad_prompts(prompts, device)
    cap = longest_continuation(lm, int(lengths.max()))
    if cap is not None and L > cap:
        fix = f"use --L {cap} or less" if cap >= 1 else "use a shorter prompt"
        raise UserError(
            f"prompt of {int(lengths.max())} tokens + L={L} exceeds the "
            f"{lm.cfg['model'].upper()} context window of {lm.cfg['block_size']} "
            f"tokens: {fix}"
        )
    with eval_mode(lm):
        stepper = CachedStepper(lm)
        if decoder == "beam":
            return _beam(
                stepper, padded, lengths, L, options["beam_size"], options["length_penalty"]
            )
        # The consistent top-k / nucleus (Welleck et al. 2020) keep eos in every V_t.
        always = None
        if options["consistent"]:
            always = lm.eos_id
        filt = dict(
            decoder=decoder,
            k=options["k"],
            p=options["p"],
            temperature=options["temperature"],
            always=always,
        )
        return _sample(stepper, padded, lengths, L, filt, generator)


def longest_continuation(lm, prompt_len):
    """The most tokens a windowed model (GPT, GCNN) can generate after a prompt of prompt_len
    tokens: the last one is never fed back, so prompt_len + L - 1 <= block_size.  None: no
    window (RNN, LSTM)."""
    return lm.cfg["block_size"] - prompt_len + 1 if lm.cfg["model"] in WINDOWED else None


def decode_in_batches(lm, prompts, L, batch=64, desc=None, **options):
    """decode() over many prompts, `batch` at a time (a tqdm bar when `desc` is given): what
    evaluate.py's study and its termination probe both run, batched the same way so that they
    decode the same.  options: decode()'s (decoder, generator, k, ...).
    -> decode()'s dict for all prompts."""
    parts = [
        decode(lm, prompts[lo : lo + batch], L, **options)
        for lo in tqdm(
            range(0, len(prompts), batch), desc, disable=None if desc else True, leave=False
        )
    ]
    return dict(
        tokens=[x for r in parts for x in r["tokens"]],
        **{k: torch.cat([r[k] for r in parts]) for k in ("lengths", "terminated", "scores")},
    )


def pad_prompts(prompts, device):
    """A list of 1-D prompts (or an (N, P) tensor) -> right-padded (N, P) and lengths (N,)."""
    prompts = list(prompts)  # (an (N, P) tensor: its rows)
    if len(prompts) == 0:
        raise UserError("no prompts to decode")
    lengths = torch.tensor([len(x) for x in prompts], device=device)
    if int(lengths.min()) < 1:
        raise UserError("every prompt needs at least one token")
    padded = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long, device=device)
    for i, x in enumerate(prompts):
        padded[i, : len(x)] = torch.as_tensor(x, device=device)
    return padded, lengths


STORY_DECODERS = ("greedy", "sample", "topk")  # insertion decoding: slot, then token
# The decoders' own arguments and their defaults (none given).
DECODER_OPTIONS = dict(
    k=None, p=None, beam_size=None, temperature=1.0, consistent=False, length_penalty=0.0
)


def check_decoder_args(decoder, allowed=DECODERS, **options):
    """Every entry point's decoder flags, for every kind of checkpoint: the decoder's own
    arguments (options: DECODER_OPTIONS's keywords) present and in range, and none it would
    silently ignore."""
    if set(options) - set(DECODER_OPTIONS):
        raise TypeError(f"unknown decoder options {sorted(set(options) - set(DECODER_OPTIONS))}")
    options = dict(DECODER_OPTIONS, **options)
    k, p, beam_size = options["k"], options["p"], options["beam_size"]
    if decoder not in allowed:
        what = "is not for this checkpoint" if decoder in DECODERS else "is unknown"
        raise UserError(f"--decoder {decoder} {what} (choose from {', '.join(allowed)})")
    unused = [
        f
        for f, given, users in (
            ("--k", k is not None, ("topk",)),
            ("--p", p is not None, ("nucleus",)),
            ("--beam_size", beam_size is not None, ("beam",)),
            ("--temperature", options["temperature"] != 1.0, SAMPLING),
            ("--consistent", options["consistent"], ("topk", "nucleus")),
            ("--length_penalty", bool(options["length_penalty"]), ("beam",)),
        )
        if given and decoder not in users
    ]
    if unused:
        raise UserError(f"--decoder {decoder} does not use {' / '.join(unused)}: drop it")
    if decoder == "topk" and (k is None or int(k) < 1):
        raise UserError(f"top-k needs --k >= 1, got {k}")
    if decoder == "nucleus" and (p is None or not 0.0 < float(p) <= 1.0):
        raise UserError(f"nucleus needs --p in (0, 1], got {p}")
    if decoder == "beam" and (beam_size is None or int(beam_size) < 1):
        raise UserError(f"beam search needs --beam_size >= 1, got {beam_size}")


def add_decoding_flags(p):
    """The decoders' flags, as evaluate.py and sample.py take them."""
    p.add_argument("--decoder", choices=DECODERS, help="decode every context (the study)")
    p.add_argument("--k", type=INT1, help="top-k")
    p.add_argument("--p", type=number(float, lambda v: 0 < v <= 1, "in (0, 1]"), help="nucleus mu")
    p.add_argument("--beam_size", type=number(int, lambda v: 1 <= v <= 1000, "in [1, 1000]"))
    p.add_argument("--temperature", type=POS, default=1.0, help="sampling temperature")
    p.add_argument("--consistent", action="store_true", help="top-k / nucleus: always keep eos")
    p.add_argument(
        "--length_penalty",
        type=number(float, lambda v: v >= 0, ">= 0"),
        default=0.0,
        help="beam: s / |y|^a",
    )
    p.add_argument("--seed", type=SEED, help="sampling seed")


def decoder_options(a):
    """The decoder's own arguments among the parsed decoding flags: {k, p, beam_size, ...}."""
    return {name: getattr(a, name) for name in DECODER_OPTIONS}


def draw(log_q, generator=None):
    """One sample per row of exp(log_q) (N, V), drawn where log_q lives, with `generator`
    (which must live there too: make it with sampling_generator).  -> (N,) long."""
    if generator is not None and generator.device != log_q.device:
        raise ValueError(
            f"the sampling generator is on {generator.device} but the "
            f"probabilities on {log_q.device}: use decode.sampling_generator"
        )
    return torch.multinomial(log_q.exp(), 1, generator=generator).squeeze(1)


def sampling_generator(device, seed):
    """The random generator of a decode with --seed, on the model's device (sampling runs
    there; the same seed gives the same samples on the same kind of device)."""
    return torch.Generator(device=device).manual_seed(seed)


def _sample(stepper, prompts, lengths, L, filt, generator):
    """Greedy (eq. 8) and the sampling decoders (eq. 12-15): one token per active row per step,
    everything kept on the model's device; one read per step (how many rows just ended).
    filt: filter_log_probs's decoder, k, p, temperature, always."""
    N, dev = len(lengths), prompts.device
    tokens = torch.full((N, L), -1, dtype=torch.long, device=dev)
    scores = torch.zeros(N, dtype=torch.float64, device=dev)
    out_len = torch.full((N,), L, dtype=torch.long, device=dev)
    terminated = torch.zeros(N, dtype=torch.bool, device=dev)
    active = torch.arange(N, device=dev)  # prompt index of every row the stepper holds
    log_probs = stepper.start(prompts, lengths)
    for t in range(1, L + 1):
        if filt["decoder"] == "greedy":
            choice = log_probs.argmax(-1)  # eq. 8
        else:
            choice = draw(filter_log_probs(log_probs.float(), **filt), generator)
        tokens[active, t - 1] = choice
        scores[active] += log_probs.gather(1, choice.unsqueeze(1)).squeeze(1).double()
        ended = choice == stepper.lm.eos_id
        out_len[active] = torch.where(ended, t, out_len[active])
        terminated[active] |= ended
        if t == L:
            break
        n_ended = int(ended.sum())  # the step's one read
        if n_ended == len(active):
            break
        if n_ended:  # drop finished rows from the batch (and from the model state)
            keep = (~ended).nonzero().squeeze(1)
            stepper.reorder(keep)
            active, choice = active[keep], choice[keep]
        log_probs = stepper.advance(choice, t + 1)
    return _result(tokens.cpu(), out_len.cpu(), terminated.cpu(), scores.cpu())


def _beam(stepper, prompts, lengths, L, k, length_penalty):
    """Beam search, Definition A.3: keep k prefixes P_t; expand each by its top-k tokens
    (eq. 16-17) and keep the k best of the k x k candidates by s(rho) = sum of log-probs
    (eq. 18).  A prefix of P_t that ends with eos goes to the final set P and is not expanded;
    the search for a prompt ends once P holds k sequences, and returns argmax_{rho in P} s(rho)
    (eq. 19) (with length_penalty a > 0: s / |rho|^a, off by default).  If P is not full after
    L steps the continuation is non-terminated: the best unfinished prefix (L tokens)."""
    N, dev, eos_id = len(lengths), prompts.device, stepper.lm.eos_id
    rows = torch.arange(N, device=dev).repeat_interleave(k)  # every prompt's k beams
    log_probs = stepper.start(prompts, lengths)[rows]  # one encoding per prompt, k copies
    stepper.reorder(rows)
    score = torch.full((N, k), float("-inf"), dtype=torch.float64, device=dev)
    score[:, 0] = 0.0  # all beams start as the same empty prefix: expand only one of them
    prefix = torch.zeros(N, k, 0, dtype=torch.long, device=dev)
    finished = [[] for _ in range(N)]  # P: (score, tokens) per prompt
    n_finished = torch.zeros(N, dtype=torch.long, device=dev)
    active = torch.arange(N, device=dev)  # prompt index of each group of k rows
    for t in range(1, L + 1):
        n, kk = len(active), min(k, log_probs.size(-1))
        top_lp, top_tok = torch.topk(log_probs, kk, dim=-1)  # eq. 17, (n*k, kk)
        cand = (score.view(n * k, 1) + top_lp.double()).view(n, k * kk)  # eq. 16
        best, pos = torch.topk(cand, k, dim=-1)  # eq. 18, (n, k)
        beam_of, tok = pos // kk, top_tok.view(n, k * kk).gather(1, pos)
        prefix = torch.cat(
            [
                prefix.gather(1, beam_of.unsqueeze(-1).expand(-1, -1, prefix.size(-1))),
                tok.unsqueeze(-1),
            ],
            dim=-1,
        )
        ends = (tok == eos_id) & torch.isfinite(best)
        score = best.masked_fill(ends, float("-inf"))  # finished prefixes are not expanded
        for g, b in ends.nonzero().tolist():
            finished[int(active[g])].append((best[g, b].item(), prefix[g, b].tolist()))
        n_finished.index_add_(0, active, ends.sum(1))
        done = n_finished[active] >= k
        if t == L or bool(done.all()):
            break
        keep = (~done).nonzero().squeeze(1)
        stepper.reorder((keep.unsqueeze(1) * k + beam_of[keep]).reshape(-1))  # rows to go on from
        active, score, prefix, tok = active[keep], score[keep], prefix[keep], tok[keep]
        log_probs = stepper.advance(tok.reshape(-1), t + 1)
    unfinished = {int(a): (score[g], prefix[g]) for g, a in enumerate(active.tolist())}
    return _beam_result(finished, unfinished, N, L, k, length_penalty)


def _beam_result(finished, unfinished, N, L, k, length_penalty):
    """eq. 19 over each prompt's final set P when it holds k sequences; else the best prefix
    still in the beam (non-terminated)."""
    tokens = torch.full((N, L), -1, dtype=torch.long)
    out_len = torch.full((N,), L, dtype=torch.long)
    terminated = torch.zeros(N, dtype=torch.bool)
    scores = torch.full((N,), float("-inf"), dtype=torch.float64)

    def norm(candidate):
        score, seq = candidate
        if length_penalty:
            return score / len(seq) ** length_penalty
        return score

    for i in range(N):
        if len(finished[i]) >= k:
            s, seq = max(finished[i], key=norm)
            tokens[i, : len(seq)] = torch.tensor(seq)
            out_len[i], terminated[i], scores[i] = len(seq), True, s
        else:
            s, pre = unfinished[i]
            b = int(torch.argmax(torch.where(torch.isfinite(s), s, -1e300)))
            tokens[i] = pre[b].cpu()
            scores[i] = s[b].item()
    return _result(tokens, out_len, terminated, scores)


def _result(tokens, lengths, terminated, scores):
    return dict(
        tokens=[row[:n].tolist() for row, n in zip(tokens, lengths.tolist())],
        lengths=lengths,
        terminated=terminated,
        scores=scores,
    )


# --- statistics of a set of decodes (NMST paper section 4, Table 2-4, Fig. 2, 7, 8) -----------
def non_termination_ratio(lengths, terminated, L):
    """eq. 11: r_nt(L) = q(|y| > L), estimated as the share of continuations with no eos within
    their first L tokens.  lengths / terminated from one decode run to max(L) >= L."""
    lengths, terminated = torch.as_tensor(lengths), torch.as_tensor(terminated)
    return float((~terminated | (lengths > L)).double().mean())


def decode_stats(result, Ls):
    """r_nt(L) for every L, the mean length, and the share of unique non-terminated
    continuations."""
    lengths, terminated = result["lengths"], result["terminated"]
    nonterm = [tuple(t) for t, done in zip(result["tokens"], terminated.tolist()) if not done]
    return dict(
        r_nt={int(L): non_termination_ratio(lengths, terminated, L) for L in Ls},
        mean_length=float(lengths.double().mean()),
        n=len(lengths),
        n_non_terminated=len(nonterm),
        unique_non_terminated=(len(set(nonterm)) / len(nonterm)) if nonterm else math.nan,
    )


@torch.no_grad()
def eos_probs(lm, context, continuation):
    """p(eos | x, y_<t) for t = 1..|y|, the quantity of NMST paper Fig. 3, from one
    teacher-forced pass over x and y (lists of ids; y's last token is not read)."""
    device = next(lm.parameters()).device
    seq = torch.tensor([*context, *continuation[:-1]], device=device).unsqueeze(0)  # (1, n)
    t = (torch.arange(seq.size(1), device=device) - len(context) + 2).unsqueeze(0)  # (1, n)
    with eval_mode(lm):
        log_p, _ = lm.log_probs(seq, t)  # (1, n, V)
    return log_p[0, len(context) - 1 :, lm.eos_id].exp().tolist()
