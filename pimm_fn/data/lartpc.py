"""Seeded LArTPC-like particle-imaging events, random-access by (seed, index).

A stand-in for PILArNet-M when the real files are not at hand: event ``index`` of run
``seed`` is generated on demand from ``np.random.default_rng([seed, index])``, so an epoch
of a million events needs no disk and any event can be regenerated alone (a few ms each).

What it follows from the published data set (PILArNet, Adams et al., arXiv 2006.01993,
and its PILArNet-M release used for point-cloud pre-training):

* a cubic 768^3 voxel grid of ~3 mm voxels (2.3 m on a side); each voxel holds the
  energy deposited in it (here in MeV, summed over every deposit in the voxel);
* five semantic classes, in this order: 0 shower (EM cascades), 1 track (muons, pions,
  protons), 2 Michel electron, 3 delta ray, 4 low-energy deposit; a voxel takes the class
  of the particle that deposited the most energy in it;
* events mixing several interaction vertices with particles from independent points
  ("particle rain"), particle types muon / proton / pion / electron / photon;
* size: ~1.2M events and ~5.2B points, i.e. a few thousand voxels per event; here the
  mean is ~3k voxels, ranging from a few hundred to ~10k.

Physics kept (liquid argon, PDG constants): minimum-ionising dE/dx 2.1 MeV/cm, a
Bragg-curve dE/dx = A R^b of the residual range R (the power law fitted in LArTPC
particle identification: A = 17 MeV/cm, b = -0.42 for protons; A = 8, b = -0.37 for
muons; pions scaled from muons by mass) so energy per voxel rises toward a stopping end;
Highland multiple-scattering angles from the momentum left at each step; gamma-distributed
per-step fluctuations; EM cascades in Rossi's spirit (radiation length 14 cm, critical
energy 32 MeV, photon conversion length 9/7 X0, energy roughly halved at each
bremsstrahlung or pair split); Michel electrons from the 52.8 MeV decay spectrum at
stopping muon ends (and pi -> mu -> e at stopping pion ends); delta rays with a 1/T^2
spectrum and the kinematic emission angle off muon and pion tracks.

Simplified (on purpose, for speed and clarity): no electric field, drift, diffusion,
recombination, readout or noise; no hadronic physics beyond "a stopping pion may knock
out a proton or two"; photons below 4 MeV become one small Compton-like blob (a
low-energy deposit) and above it always pair-convert; electron dE/dx is constant; the
scattering walk is an exponential-map random walk per path (vectorised, not a step-by-step
rotation); shower electrons above the critical energy fly straight between radiations and
turn by their accumulated scattering angle at each; the Michel spectrum x^2 (3 - 2x) is
drawn as Beta(3, 1.3) (same mean); a Michel electron's radiated energy becomes nearby
low-energy blobs; the energy of delta rays is not subtracted from the parent track. The numbers of vertices,
particles and their energies are chosen to give PILArNet-like voxel counts, not fitted.

Units: positions in mm inside the generator; the returned ``coord`` is the voxel centre
in voxel units (``grid_coord + 0.5``; multiply by ``voxel_mm`` for mm), ``energy`` in MeV.
"""
from __future__ import annotations

import operator
from typing import Optional, Sequence

import numpy as np
import torch

CLASS_NAMES = ("shower", "track", "michel", "delta", "low_energy")
SHOWER, TRACK, MICHEL, DELTA, LOW_ENERGY = range(5)

GRID = 768
VOXEL_MM = 3.0

# liquid argon (PDG)
MIP_MEV_PER_CM = 2.1
MIP_MEV_PER_MM = MIP_MEV_PER_CM / 10
X0_MM = 140.0
CRITICAL_MEV = 32.0
PAIR_MFP_MM = 9.0 / 7.0 * X0_MM
COMPTON_MEV = 4.0       # photons below this deposit one small blob instead of converting
MICHEL_MAX_MEV = 52.8

# Charged species traced as paths: mass (MeV) and the Bragg power law dE/dx = A R^b
# (MeV/cm, R in cm). Electrons (A = 0) lose the minimum-ionising rate throughout.
SPECIES = ("muon", "proton", "pion", "electron")
MUON, PROTON, PION, ELECTRON = range(4)
_MASS = np.array([105.66, 938.27, 139.57, 0.511])
_BRAGG_A = np.array([8.0, 17.0, 8.0 * (105.66 / 139.57) ** -0.37, 0.0])
_BRAGG_B = np.array([-0.37, -0.42, -0.37, 0.0])

# Kinds in the optional particle table.
KINDS = ("muon", "proton", "pion", "electron", "photon", "michel", "delta", "low_energy")

# Event composition: primaries are drawn with these probabilities (muon, proton, pion,
# electron, photon); ranges (mm) and energies (MeV) log-uniform in these bounds.
_PRIMARY_P = np.array([0.28, 0.32, 0.16, 0.12, 0.12])
_RANGE_MM = {MUON: (100.0, 3000.0), PROTON: (5.0, 300.0), PION: (50.0, 1500.0)}
_EM_MEV = (30.0, 1000.0)


# --------------------------------------------------------------------------- geometry


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def _isotropic(rng: np.random.Generator, n: int) -> np.ndarray:
    return _unit(rng.standard_normal((n, 3)))


def _cross(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # np.cross's axis handling costs more than the product itself for these small arrays
    return np.stack([a[:, 1] * b[:, 2] - a[:, 2] * b[:, 1], a[:, 2] * b[:, 0] - a[:, 0] * b[:, 2],
                     a[:, 0] * b[:, 1] - a[:, 1] * b[:, 0]], 1)


def _basis(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two unit vectors completing each row of ``w`` (unit [P,3]) to an orthonormal frame."""
    # w x e_x = (0, w_z, -w_y), or w x e_y = (-w_z, 0, w_x) when w is near e_x
    near_x = np.abs(w[:, 0]) >= 0.9
    zero = np.zeros(len(w))
    u = np.stack([np.where(near_x, -w[:, 2], zero), np.where(near_x, zero, w[:, 2]),
                  np.where(near_x, w[:, 0], -w[:, 1])], 1)
    u = _unit(u)
    return u, _cross(w, u)


def _cone(rng: np.random.Generator, axis: np.ndarray, cos_t: np.ndarray) -> np.ndarray:
    """Directions at polar angle acos(cos_t) around each ``axis`` row, uniform azimuth."""
    u, v = _basis(axis)
    phi = rng.uniform(0.0, 2 * np.pi, len(axis))
    sin_t = np.sqrt(np.clip(1.0 - cos_t ** 2, 0.0, 1.0))
    return (axis * cos_t[:, None]
            + (u * np.cos(phi)[:, None] + v * np.sin(phi)[:, None]) * sin_t[:, None])


def _kick(rng: np.random.Generator, axis: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """Deflect each ``axis`` row by a 2-D Gaussian angle of width ``sigma`` (radians)."""
    theta = np.asarray(sigma) * np.sqrt(-2.0 * np.log(rng.uniform(1e-12, 1.0, len(axis))))
    return _cone(rng, axis, np.cos(theta))


def _segment_cumsum(x: np.ndarray, first: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Inclusive cumulative sum of ``x`` (rows grouped in runs of ``count``) restarting at
    each run's ``first`` row."""
    c = np.cumsum(x, axis=0)
    return c - np.repeat(c[first] - x[first], count, axis=0)


# --------------------------------------------------------------------------- energy loss


def dedx(residual_cm: np.ndarray, species) -> np.ndarray:
    """Stopping power (MeV/cm) at ``residual_cm`` from the stopping point: the Bragg power
    law A R^b floored at the minimum-ionising 2.1 MeV/cm (electrons: 2.1 flat)."""
    sp = np.asarray(species)
    r = np.maximum(residual_cm, 0.02)  # the power law diverges at R = 0; cap the last step
    return np.maximum(MIP_MEV_PER_CM, _BRAGG_A[sp] * r ** _BRAGG_B[sp])


def kinetic_energy(residual_cm: np.ndarray, species) -> np.ndarray:
    """Kinetic energy (MeV) of a particle with ``residual_cm`` of range left: the integral
    of :func:`dedx` from the stopping point."""
    sp = np.asarray(species)
    a, b = _BRAGG_A[sp], _BRAGG_B[sp]
    bragg = a > 0
    a1, b1 = np.where(bragg, a, 1.0), np.where(bragg, b, -0.5)
    r_star = (MIP_MEV_PER_CM / a1) ** (1.0 / b1)  # where the power law meets the MIP floor
    r = np.minimum(residual_cm, r_star)
    ke = a1 * r ** (b1 + 1) / (b1 + 1) + MIP_MEV_PER_CM * np.maximum(residual_cm - r_star, 0.0)
    return np.where(bragg, ke, MIP_MEV_PER_CM * residual_cm)


def trace_paths(rng: np.random.Generator, start, direction, range_mm, species, *,
                length_mm=None, step_mm: float = 1.5, scatter=True) -> dict:
    """Trace charged particles through argon as multiple-scattering paths of short steps.

    All P paths are traced at once (no per-path Python loop). start [P,3] mm;
    direction [P,3] (normalised here); range_mm [P]: the residual (CSDA) range at the
    start; species [P]: indices into :data:`SPECIES`; length_mm [P]: how far to trace
    (default the whole range: a stopping particle; shorter for a shower electron that
    radiates before it stops); scatter: bool or [P] bools, which paths scatter (the
    others are straight). Each step deposits dE/dx(residual range) x step times a
    gamma(4) fluctuation of mean 1 and is deflected by a Highland angle.

    Returns pos [M,3] (step midpoints, mm), energy [M] (MeV), path [M] (path of each
    step), residual [M] (mm), dir [M,3], first [P] / count [P] (each path's rows),
    end [P,3] and end_dir [P,3].
    """
    start = np.asarray(start, dtype=np.float64).reshape(-1, 3)
    p = len(start)
    w = _unit(np.asarray(direction, dtype=np.float64).reshape(p, 3))
    full = np.broadcast_to(np.asarray(range_mm, dtype=np.float64), (p,))
    length = full if length_mm is None else np.minimum(np.broadcast_to(length_mm, (p,)), full)
    sp_path = np.broadcast_to(np.asarray(species, dtype=np.int64), (p,))
    count = np.maximum(1, np.ceil(length / step_mm)).astype(np.int64)
    first = np.cumsum(count) - count
    m = int(count.sum())

    def per_step(x):  # np.repeat: several times faster than fancy-indexing rows by path
        return np.repeat(x, count, axis=0)

    path = per_step(np.arange(p))
    k = np.arange(m) - per_step(first)
    ds = per_step(length / count)
    residual = per_step(full) - (k + 0.5) * ds
    res_cm = residual / 10.0
    bragg = _BRAGG_A[sp_path] > 0
    per_path = not isinstance(scatter, (bool, np.bool_))
    scatters = bool(np.asarray(scatter).any()) if per_path else bool(scatter)
    if bragg.any():
        sp = per_step(sp_path)
        loss = dedx(res_cm, sp)
        ke = kinetic_energy(res_cm, sp) if scatters else None
        mass = _MASS[sp]
    else:  # electrons only (shower cascades): flat dE/dx, no powers to take
        loss = np.full(m, MIP_MEV_PER_CM)
        ke = MIP_MEV_PER_CM * res_cm
        mass = _MASS[ELECTRON]
    energy = loss * (ds / 10.0) * rng.standard_gamma(4.0, m) * 0.25
    if scatters:
        pc2 = ke * (ke + 2 * mass)
        beta_pc = pc2 / (ke + mass)
        # Highland width per step (without its log term, which does not add over steps)
        sigma = np.minimum(0.5, 13.6 / np.maximum(beta_pc, 1e-3) * np.sqrt(ds / X0_MM))
        if per_path:
            sigma *= per_step(np.asarray(scatter, dtype=np.float64))
        kicks = rng.standard_normal((2, m)) * sigma
        wa = _segment_cumsum(kicks[0], first, count)
        wb = _segment_cumsum(kicks[1], first, count)
        # exponential map of the tangent-plane walk onto the sphere: the direction keeps
        # wandering at the Highland rate however far it has turned (a plain sum of kicks
        # added to the start direction would freeze once the sum dominates)
        u, v = _basis(w)
        r = np.sqrt(wa * wa + wb * wb)
        sinc = np.sin(r) / np.maximum(r, 1e-12)  # r = 0 only where wa = wb = 0
        d = (per_step(w) * np.cos(r)[:, None] + per_step(u) * (wa * sinc)[:, None]
             + per_step(v) * (wb * sinc)[:, None])
    else:
        d = per_step(w)
    step = d * ds[:, None]
    pos = per_step(start) + _segment_cumsum(step, first, count) - 0.5 * step
    last = first + count - 1
    return dict(pos=pos, energy=energy, path=path, residual=residual, dir=d, first=first,
                count=count, end=pos[last] + 0.5 * step[last], end_dir=d[last])


def _blobs(rng: np.random.Generator, centre: np.ndarray, energy: np.ndarray):
    """Small isolated deposits: 1-3 points within ~2 mm of each centre sharing its energy."""
    n = rng.integers(1, 4, len(centre))
    owner = np.repeat(np.arange(len(centre)), n)
    share = rng.uniform(0.2, 1.0, len(owner))
    share /= np.bincount(owner, share, len(centre))[owner]
    pos = centre[owner] + rng.normal(0.0, 2.0, (len(owner), 3))
    return pos, energy[owner] * share, owner


def _cascade(rng: np.random.Generator, pos, dirn, energy, photon, group, step_mm):
    """An EM cascade of every seed at once, one generation per loop turn.

    Electrons above the critical energy travel ~X0 ln 2 in a straight line, then radiate
    a photon with 30-70 % of their energy and turn by their Highland angle over that hop;
    below it they range out along a scattering path. Photons fly an exponential gap, then
    convert into an e+e- pair splitting their energy 25-75 %, or end as a blob when soft.
    Only the cheap bookkeeping runs per generation; every electron is traced in one
    :func:`trace_paths` call at the end. Returns the traced steps (pos, energy, group) and
    the soft-photon blobs (centres, energies).
    """
    segs, blobs = [], []
    for _ in range(40):  # a 1.5 GeV shower ends in ~10 generations; the bound is a guard
        if len(energy) == 0:
            break
        new = []  # (pos, axis, kick sigma, energy, is photon, group) of the next generation
        ph = photon
        if ph.any():
            p_pos, p_dir, p_e, p_g = pos[ph], dirn[ph], energy[ph], group[ph]
            conv = p_pos + p_dir * rng.exponential(PAIR_MFP_MM, len(p_e))[:, None]
            soft = p_e < COMPTON_MEV
            if soft.any():
                blobs.append((conv[soft], p_e[soft] * rng.uniform(0.3, 1.0, int(soft.sum()))))
            hard = ~soft
            if hard.any():
                e_parent, g, at, axis = p_e[hard], p_g[hard], conv[hard], p_dir[hard]
                u = rng.uniform(0.25, 0.75, len(e_parent))
                e_pair = np.concatenate([e_parent * u, e_parent * (1 - u)])
                # opening angle grows as the energy falls: what widens the shower's cone
                new.append((np.concatenate([at, at]), np.concatenate([axis, axis]),
                            np.minimum(0.6, 4.0 / e_pair), e_pair,
                            np.zeros(len(e_pair), bool), np.concatenate([g, g])))
        el = ~photon
        if el.any():
            e_pos, e_dir, e_e, e_g = pos[el], dirn[el], energy[el], group[el]
            full = e_e / MIP_MEV_PER_MM
            stops = e_e <= CRITICAL_MEV
            hop = np.minimum(rng.exponential(X0_MM * np.log(2), len(e_e)),
                             (e_e - CRITICAL_MEV) / MIP_MEV_PER_MM)
            length = np.where(stops, full, np.maximum(hop, step_mm))
            segs.append((e_pos, e_dir, full, length, e_g, stops))
            go = ~stops
            if go.any():
                length, e_e, g, axis = length[go], e_e[go], e_g[go], e_dir[go]
                end = e_pos[go] + axis * length[:, None]
                left = np.maximum(e_e - MIP_MEV_PER_MM * length, 1e-3)
                # the hop's scattering, applied as one turn at its end (the photon adds
                # its own emission angle in quadrature)
                turn = np.minimum(0.5, 13.6 / e_e * np.sqrt(length / X0_MM))
                f = rng.uniform(0.3, 0.7, len(left))
                emit = np.minimum(0.5, 2.0 / (left * f))
                new.append((np.concatenate([end, end]), np.concatenate([axis, axis]),
                            np.concatenate([np.hypot(turn, emit), turn]),
                            np.concatenate([left * f, left * (1 - f)]),
                            np.r_[np.ones(len(left), bool), np.zeros(len(left), bool)],
                            np.concatenate([g, g])))
        if not new:
            break
        pos, axis, sigma, energy, photon, group = (np.concatenate(x) for x in zip(*new))
        dirn = _kick(rng, axis, sigma)  # one call per generation: numpy overhead, not work, dominates
    if not segs:
        return [], blobs
    start, direction, full, length, g, scatter = (np.concatenate(x) for x in zip(*segs))
    tr = trace_paths(rng, start, direction, full, ELECTRON, length_mm=length, step_mm=step_mm,
                     scatter=scatter)
    return [(tr["pos"], tr["energy"], g[tr["path"]])], blobs


# --------------------------------------------------------------------------- voxels


def voxelize(pos_mm: np.ndarray, energy: np.ndarray, particle: np.ndarray,
             particle_class: np.ndarray, *, grid: int = GRID, voxel_mm: float = VOXEL_MM):
    """Sum deposits per voxel of a ``grid``^3 grid starting at the origin; points outside dropped.

    particle [M]: the id of the particle of each deposit; particle_class [P]: its class.
    Returns grid_coord [V,3] int64 (sorted, unique), energy [V] float64 and segment [V]
    int64: the class of the particle that deposited the most energy in the voxel.
    """
    g = np.floor(pos_mm / voxel_mm).astype(np.int64)
    inside = ((g >= 0) & (g < grid)).all(1)
    g, energy, particle = g[inside], energy[inside], particle[inside]
    if len(g) == 0:
        return np.zeros((0, 3), np.int64), np.zeros(0), np.zeros(0, np.int64)
    n_p = int(particle_class.shape[0])
    # one sort over (voxel, particle) pairs gives both the voxel sums and the per-voxel
    # energy of each particle (grid^3 * n_p stays far inside int64)
    key = (g[:, 0] * grid + g[:, 1]) * grid + g[:, 2]
    pair_key = key * n_p + particle
    order = np.argsort(pair_key)
    sorted_key = pair_key[order]
    new_pair = np.r_[True, sorted_key[1:] != sorted_key[:-1]]
    pairs = sorted_key[new_pair]
    pair_e = np.bincount(np.cumsum(new_pair) - 1, energy[order], len(pairs))
    vkey = pairs // n_p
    new = np.r_[True, vkey[1:] != vkey[:-1]]
    vid = np.cumsum(new) - 1
    n_vox = int(vid[-1]) + 1
    vox_e = np.bincount(vid, pair_e, n_vox)
    order = np.lexsort((pair_e, vid))  # by voxel, then energy: each voxel's last is its max
    best = order[np.r_[vid[order][1:] != vid[order][:-1], True]]
    segment = particle_class[pairs[best] % n_p]
    uk = vkey[new]
    grid_coord = np.stack([uk // (grid * grid), (uk // grid) % grid, uk % grid], 1)
    return grid_coord, vox_e, segment.astype(np.int64)


# --------------------------------------------------------------------------- events


def _log_uniform(rng, lo, hi, n):
    return np.exp(rng.uniform(np.log(lo), np.log(hi), n))


def lartpc_event(seed: int, index: int, *, grid: int = GRID, voxel_mm: float = VOXEL_MM,
                 step_mm: float = 1.5, particles: bool = False) -> dict:
    """Event ``index`` of run ``seed``: a pure function of (seed, index) (and the options).

    grid: voxels per side; voxel_mm: voxel pitch; step_mm: tracing step (half a voxel
    by default, so a path leaves no voxel it crosses empty); particles: also return the
    particle table (for tests and plots).

    Returns numpy arrays: ``coord`` [N,3] float32 (voxel centres in voxel units),
    ``grid_coord`` [N,3] int64, ``energy`` [N,1] float32 (MeV), ``segment`` [N] int64
    (:data:`CLASS_NAMES`); with ``particles``, ``particles`` = dict of kind [P]
    (:data:`KINDS`), cls [P], parent [P] (-1 for primaries), start [P,3] / end [P,3]
    (mm), energy [P] (initial kinetic energy, MeV).
    """
    if seed < 0 or index < 0:
        raise ValueError(f"seed and index must be >= 0, got {seed}, {index}")
    rng = np.random.default_rng([int(seed), int(index)])
    size = grid * voxel_mm

    # ---- primaries: 1 + Poisson(1.5) vertices with 2 + Poisson(2.5) particles each, plus
    # Poisson(2) single "rain" particles from random points
    n_vtx = 1 + rng.poisson(1.5)
    mult = 2 + rng.poisson(2.5, n_vtx)
    n_rain = rng.poisson(2.0)
    origin = np.concatenate([np.repeat(rng.uniform(0.15, 0.85, (n_vtx, 3)) * size, mult, 0),
                             rng.uniform(0.05, 0.95, (n_rain, 3)) * size])
    kind = rng.choice(5, len(origin), p=_PRIMARY_P)
    direction = _isotropic(rng, len(origin))

    table = dict(kind=[], cls=[], parent=[], start=[], end=[], energy=[])
    deposits = []  # (pos [M,3], energy [M], particle id [M])

    def add_particles(kinds, cls, parents, starts, ends, energies):
        base = len(table["kind"])
        n = len(kinds)
        table["kind"].extend(np.broadcast_to(kinds, (n,)).tolist())
        table["cls"].extend(np.broadcast_to(cls, (n,)).tolist())
        table["parent"].extend(np.broadcast_to(parents, (n,)).tolist())
        table["start"].extend(list(starts))
        table["end"].extend(list(ends))
        table["energy"].extend(np.broadcast_to(energies, (n,)).tolist())
        return base + np.arange(n)

    # ---- tracks: muons, protons, pions, traced together
    is_track = kind < 3
    t_kind = kind[is_track]  # KINDS and SPECIES share 0 muon, 1 proton, 2 pion
    t_range = np.empty(len(t_kind))
    for sp, (lo, hi) in _RANGE_MM.items():
        t_range[t_kind == sp] = _log_uniform(rng, lo, hi, int((t_kind == sp).sum()))
    tracks = trace_paths(rng, origin[is_track], direction[is_track], t_range, t_kind, step_mm=step_mm)
    t_ids = add_particles(t_kind, TRACK, -1, origin[is_track], tracks["end"],
                          kinetic_energy(t_range / 10, t_kind))
    deposits.append((tracks["pos"], tracks["energy"], t_ids[tracks["path"]]))

    # ---- secondaries of the tracks: Michel electrons, delta rays, protons from pion ends
    end = tracks["end"]
    stopped = ((end > 0) & (end < size)).all(1)  # the stopping point lies in the volume
    u = rng.uniform(size=len(t_kind))
    michel = stopped & (((t_kind == MUON) & (u < 0.8)) | ((t_kind == PION) & (u < 0.4)))
    knock = stopped & (t_kind == PION) & (u >= 0.4) & (u < 0.8)
    sec_start, sec_dir, sec_range, sec_species, sec_parent, sec_kind, sec_cls = [], [], [], [], [], [], []

    n_mi = int(michel.sum())
    # Michel spectrum x^2 (3 - 2x), x = E / 52.8 MeV, approximated by Beta(3, 1.3) (same mean)
    e_michel = MICHEL_MAX_MEV * rng.beta(3.0, 1.3, n_mi)
    ion = rng.uniform(0.4, 0.8, n_mi)  # the rest is radiated (blobs below)
    sec_start.append(end[michel])
    sec_dir.append(_isotropic(rng, n_mi))
    sec_range.append(e_michel * ion / MIP_MEV_PER_MM)
    sec_species.append(np.full(n_mi, ELECTRON))
    sec_parent.append(t_ids[michel])
    sec_kind.append(np.full(n_mi, KINDS.index("michel")))
    sec_cls.append(np.full(n_mi, MICHEL))

    # delta rays: ~1 per 25 cm of muon/pion track, T in [2, 25] MeV with a 1/T^2 spectrum,
    # emitted at the kinematic angle cos(theta) = sqrt(T / (T + 2 m_e))
    light = (t_kind == MUON) | (t_kind == PION)
    n_delta = rng.poisson(np.where(light, tracks["count"] * step_mm / 250.0, 0.0))
    owner = np.repeat(np.arange(len(t_kind)), n_delta)
    at = tracks["first"][owner] + (rng.uniform(size=len(owner)) * tracks["count"][owner]).astype(np.int64)
    t_lo, t_hi = 2.0, 25.0
    t_delta = t_lo / (1.0 - rng.uniform(size=len(owner)) * (1.0 - t_lo / t_hi))
    cos_d = np.sqrt(t_delta / (t_delta + 2 * _MASS[ELECTRON]))
    sec_start.append(tracks["pos"][at])
    sec_dir.append(_cone(rng, tracks["dir"][at], cos_d))
    sec_range.append(t_delta / MIP_MEV_PER_MM)
    sec_species.append(np.full(len(owner), ELECTRON))
    sec_parent.append(t_ids[owner])
    sec_kind.append(np.full(len(owner), KINDS.index("delta")))
    sec_cls.append(np.full(len(owner), DELTA))

    # a stopping pion that does not decay may knock out one or two protons
    n_knock = knock.astype(np.int64) * rng.integers(1, 3, len(t_kind))
    owner = np.repeat(np.arange(len(t_kind)), n_knock)
    sec_start.append(end[owner])
    sec_dir.append(_isotropic(rng, len(owner)))
    sec_range.append(_log_uniform(rng, 5.0, 150.0, len(owner)))
    sec_species.append(np.full(len(owner), PROTON))
    sec_parent.append(t_ids[owner])
    sec_kind.append(np.full(len(owner), PROTON))
    sec_cls.append(np.full(len(owner), TRACK))

    s_start, s_range, s_species = (np.concatenate(x) for x in (sec_start, sec_range, sec_species))
    if len(s_start):
        sec = trace_paths(rng, s_start, np.concatenate(sec_dir), s_range, s_species, step_mm=step_mm)
        s_ids = add_particles(np.concatenate(sec_kind), np.concatenate(sec_cls),
                              np.concatenate(sec_parent), s_start, sec["end"],
                              kinetic_energy(s_range / 10, s_species))
        deposits.append((sec["pos"], sec["energy"], s_ids[sec["path"]]))

    # ---- EM showers from primary electrons and photons (photons start after a gap)
    is_em = kind >= 3
    e_em = _log_uniform(rng, *_EM_MEV, int(is_em.sum()))
    sh_ids = add_particles(kind[is_em], SHOWER, -1, origin[is_em], origin[is_em], e_em)
    steps, soft = _cascade(rng, origin[is_em], direction[is_em], e_em, kind[is_em] == 4,
                           sh_ids, step_mm)
    deposits.extend(steps)

    # ---- low-energy deposits: soft shower photons, Michel brems, and scattered Compton-like
    # blobs around the activity (de-excitation photons, neutrons' recoils, ...)
    led_id = add_particles([KINDS.index("low_energy")], LOW_ENERGY, -1, np.zeros((1, 3)),
                           np.zeros((1, 3)), 0.0)[0]
    everything = np.concatenate([d[0] for d in deposits])
    n_amb = rng.poisson(60)
    anchor = everything[rng.integers(0, len(everything), n_amb)]
    amb = anchor + _isotropic(rng, n_amb) * rng.exponential(120.0, n_amb)[:, None]
    centres = [amb]
    energies = [0.05 + rng.exponential(0.5, n_amb)]
    n_brem = rng.integers(0, 3, n_mi)
    brem_owner = np.repeat(np.arange(n_mi), n_brem)
    centres.append(end[michel][brem_owner]
                   + _isotropic(rng, len(brem_owner)) * rng.exponential(80.0, len(brem_owner))[:, None])
    radiated = e_michel * (1 - ion)
    energies.append(radiated[brem_owner] / np.maximum(n_brem[brem_owner], 1))
    for c, e in soft:
        centres.append(c)
        energies.append(e)
    b_pos, b_e, _ = _blobs(rng, np.concatenate(centres), np.concatenate(energies))
    deposits.append((b_pos, b_e, np.full(len(b_e), led_id)))

    pos = np.concatenate([d[0] for d in deposits])
    dep_e = np.concatenate([d[1] for d in deposits])
    pid = np.concatenate([d[2] for d in deposits])
    grid_coord, vox_e, segment = voxelize(pos, dep_e, pid, np.asarray(table["cls"], np.int64),
                                          grid=grid, voxel_mm=voxel_mm)
    out = dict(coord=grid_coord.astype(np.float32) + np.float32(0.5), grid_coord=grid_coord,
               energy=vox_e.astype(np.float32)[:, None], segment=segment)
    if particles:
        out["particles"] = dict(
            kind=np.asarray(table["kind"], np.int64), cls=np.asarray(table["cls"], np.int64),
            parent=np.asarray(table["parent"], np.int64),
            start=np.asarray(table["start"], np.float64).reshape(-1, 3),
            end=np.asarray(table["end"], np.float64).reshape(-1, 3),
            energy=np.asarray(table["energy"], np.float64))
    return out


class LArTPCEvents(torch.utils.data.Dataset):
    """Map-style data set of generated LArTPC events (see :func:`lartpc_event`).

    split: "train" or "val"; they draw from disjoint seeds (2*seed and 2*seed + 1), so
    no validation event is a training event for any choice of ``seed``. num_events: the
    epoch length; nothing is generated until an event is read. grid: voxels per side.

    A sample holds ``coord`` [N,3] float32 (voxel centres, voxel units), ``grid_coord``
    [N,3] int64, ``energy`` [N,1] float32 (MeV), ``feat`` [N,1] (a copy of ``energy``,
    so the sample feeds a model without a feature transform), ``segment`` [N] int64 and
    ``name``.
    """

    class_names = CLASS_NAMES
    num_classes = len(CLASS_NAMES)

    def __init__(self, split: str = "train", num_events: int = 1_000_000, seed: int = 0, *,
                 grid: int = GRID, name: Optional[str] = None):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if seed < 0 or num_events < 0:
            raise ValueError(f"seed and num_events must be >= 0, got {seed}, {num_events}")
        self.split, self.num_events, self.seed, self.grid = split, int(num_events), int(seed), int(grid)
        self.event_seed = 2 * self.seed + (split == "val")
        self.name = name or f"lartpc[{split}]"

    def __len__(self):
        return self.num_events

    def __getitem__(self, i):
        i = operator.index(i)
        if not 0 <= i < self.num_events:
            raise IndexError(f"{self.name}: index {i} out of range {self.num_events}")
        ev = lartpc_event(self.event_seed, i, grid=self.grid)
        energy = torch.from_numpy(ev["energy"])
        return {"coord": torch.from_numpy(ev["coord"]), "grid_coord": torch.from_numpy(ev["grid_coord"]),
                "energy": energy, "feat": energy.clone(), "segment": torch.from_numpy(ev["segment"]),
                "name": f"{self.name}/{i}"}


_CLASS_COLORS = ("#ff7f0e", "#1f77b4", "#2ca02c", "#d62728", "#7f7f7f")


def render_events(path, seed: int = 0, indices: Sequence[int] = (0, 1, 2), *, grid: int = GRID) -> None:
    """Draw events (seed, i) for i in ``indices`` as 3-D scatters coloured by class into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    ncols = len(indices) if len(indices) <= 3 else 2
    nrows = -(-len(indices) // ncols)
    fig = plt.figure(figsize=(5.2 * ncols, 5.0 * nrows + 0.6))
    for j, i in enumerate(indices):
        ev = lartpc_event(seed, i, grid=grid)
        c, seg = ev["coord"], ev["segment"]
        ax = fig.add_subplot(nrows, ncols, j + 1, projection="3d")
        # dense classes first so the sparse ones (Michel, delta) are drawn on top
        for k in (SHOWER, TRACK, LOW_ENERGY, DELTA, MICHEL):
            sel = seg == k
            ax.scatter(c[sel, 0], c[sel, 1], c[sel, 2], s=1.5 if k in (SHOWER, TRACK) else 4,
                       c=_CLASS_COLORS[k], depthshade=False, linewidths=0)
        lo, hi = c.min(0), c.max(0)
        mid, half = (lo + hi) / 2, (hi - lo).max() / 2 + 5  # a cube around the event
        for setter, m in zip((ax.set_xlim, ax.set_ylim, ax.set_zlim), mid):
            setter(m - half, m + half)
        ax.set_title(f"event ({seed}, {i}): {len(c)} voxels", fontsize=10)
        ax.tick_params(labelsize=6)
    handles = [Line2D([], [], marker="o", ls="", color=col, label=name)
               for name, col in zip(CLASS_NAMES, _CLASS_COLORS)]
    fig.legend(handles=handles, loc="lower center", ncol=5, frameon=False)
    fig.tight_layout(rect=(0, 0.6 / (5.0 * nrows + 0.6), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
