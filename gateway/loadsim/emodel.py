"""The ITU-T G.107 E-model for a G.711 call: transmission rating R and estimated MOS.

The load simulator measures what a caller's phone would see (one-way delay, packet loss, gaps
counted as loss) and turns it into the rating a transmission planner would: R from G.107
(06/2015) clause 7, MOS_CQE from R by G.107 Annex B.

    R = Ro - Is - Id - Ie,eff + A                                   (G.107 eq. 7-1)

Every input that the simulator does not measure keeps its G.107 Table 3 default (loudness
ratings, sidetone, room and circuit noise, echo loss, quantizing distortion, A = 0), so:

- ``Ro - Is`` is computed once from those defaults (eqs. 7-2 to 7-17): Ro = 94.77,
  Is = 1.41, so Ro - Is = 93.35.
- ``Id = Idte + Idle + Idd`` (eq. 7-18). **All three terms are included**, at the default echo
  settings (TELR = 65 dB, WEPL = 110 dB), with the usual planning assumption that the echo
  path delay equals the one-way delay and the listener echo loop is the round trip:
  ``T = Ta = one_way_delay_ms`` and ``Tr = 2 * Ta``. With zero delay that leaves the small
  listener-echo term Idle = 0.15 of the default connection, which is what brings G.107's
  published default rating to **R = 93.2** (93.35 - 0.15). The talker-echo term Idte is not
  zero beyond a few ms (TELR = 65 dB is a well-cancelled echo, not none): about 2.8 at 150 ms
  and 3.6 at 200 ms, on top of the pure-delay term Idd (0.16 and 3.04). Dropping Idte/Idle
  would overstate R by 3 to 7 points at typical VoIP delays; with them, R matches the widely
  used fit of Cole & Rosenbluth (ACM SIGCOMM CCR 31(2), 2001) to this same default curve,
  ``Id ~ 0.024 d + 0.11 (d - 177.3) H(d - 177.3)``.
- ``Ie,eff = Ie + (95 - Ie) * Ppl / (Ppl / BurstR + Bpl)`` (eq. 7-29), with G.711's
  Ie = 0 and Bpl = 25.1 with packet loss concealment (G.711 Appendix I PLC) or 4.3 without,
  from ITU-T G.113 Appendix I.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "DEFAULT_RO_MINUS_IS",
    "EModelResult",
    "delay_impairment",
    "estimate",
    "ie_eff",
    "mos_from_r",
    "pure_delay_impairment",
    "r_factor",
]


# --- G.107 Table 3 default values (those the simulator does not measure) ----------------------
_SLR = 8.0  # send loudness rating, dB
_RLR = 2.0  # receive loudness rating, dB
_OLR = _SLR + _RLR  # overall loudness rating (G.107 clause 7.2)
_STMR = 15.0  # sidetone masking rating, dB
_LSTR = 18.0  # listener sidetone rating, dB
_DS = 3.0  # D-value of telephone, send side
_TELR = 65.0  # talker echo loudness rating, dB
_WEPL = 110.0  # weighted echo path loss, dB
_QDU = 1.0  # number of quantizing distortion units
_NC = -70.0  # circuit noise referred to the 0 dBr point, dBm0p
_NFOR = -64.0  # noise floor at the receive side, dBmp
_PS = 35.0  # room noise at the send side, dB(A)
_PR = 35.0  # room noise at the receive side, dB(A)
_MT = 100.0  # minimum perceivable delay mT, ms (G.107 Table 1, default sT = 1)
_A = 0.0  # advantage factor: 0 for conventional wirebound telephony (G.107 clause 7.6)


def _noise_and_ro() -> tuple[float, float]:
    """(No, Ro) of the default connection: G.107 eqs. 7-2 to 7-7."""
    nos = _PS - _SLR - _DS - 100.0 + 0.004 * (_PS - _OLR - _DS - 14.0) ** 2  # eq. 7-4
    pre = _PR + 10.0 * math.log10(1.0 + 10.0 ** ((10.0 - _LSTR) / 10.0))  # eq. 7-6
    nor = _RLR - 121.0 + pre + 0.008 * (pre - 35.0) ** 2  # eq. 7-5
    nfo = _NFOR + _RLR  # eq. 7-7
    no = 10.0 * math.log10(
        10.0 ** (_NC / 10.0) + 10.0 ** (nos / 10.0) + 10.0 ** (nor / 10.0) + 10.0 ** (nfo / 10.0)
    )  # eq. 7-3
    ro = 15.0 - 1.5 * (_SLR + no)  # eq. 7-2
    return no, ro


def _simultaneous_impairment(no: float, ro: float) -> float:
    """Is = Iolr + Ist + Iq of the default connection: G.107 eqs. 7-8 to 7-17 (T = 0 for Ist).

    Ist's echo term carries ``exp(-T/4) * 10^(-TELR/10)`` (eq. 7-11); at TELR = 65 dB it moves
    Ist by under 1e-5 for any T, so Is is a constant of the default connection.
    """
    xolr = _OLR + 0.2 * (64.0 + no - _RLR)  # eq. 7-10
    iolr = 20.0 * ((1.0 + (xolr / 8.0) ** 8) ** (1.0 / 8.0) - xolr / 8.0)  # eq. 7-9
    stmro = -10.0 * math.log10(10.0 ** (-_STMR / 10.0) + 10.0 ** (-_TELR / 10.0))  # eq. 7-11
    ist = (
        12.0 * (1.0 + ((stmro - 13.0) / 6.0) ** 8) ** (1.0 / 8.0)
        - 28.0 * (1.0 + ((stmro + 1.0) / 19.4) ** 35) ** (1.0 / 35.0)
        - 13.0 * (1.0 + ((stmro - 3.0) / 33.0) ** 13) ** (1.0 / 13.0)
        + 29.0
    )  # eq. 7-12
    q = 37.0 - 15.0 * math.log10(_QDU)  # eq. 7-17
    g = 1.07 + 0.258 * q + 0.0602 * q**2  # eq. 7-16
    y = (ro - 100.0) / 15.0 + 46.0 / 8.4 - g / 9.0  # eq. 7-14
    z = 46.0 / 30.0 - g / 40.0  # eq. 7-15
    iq = 15.0 * math.log10(1.0 + 10.0**y + 10.0**z)  # eq. 7-13
    return iolr + ist + iq  # eq. 7-8


_NO, _RO = _noise_and_ro()
#: Ro - Is for G.107's default connection (93.35); R is this minus Id and Ie,eff.
DEFAULT_RO_MINUS_IS: float = _RO - _simultaneous_impairment(_NO, _RO)


@dataclass(frozen=True, slots=True)
class _Codec:
    ie: float  # equipment impairment factor
    bpl_plc: float  # packet-loss robustness factor with concealment
    bpl_no_plc: float  # ... without concealment


# ITU-T G.113 Appendix I, Tables I.1 and I.3: G.711 (PCMU and PCMA alike) Ie = 0;
# Bpl = 25.1 with the PLC of G.711 Appendix I, 4.3 without concealment (random loss).
_G711 = _Codec(ie=0.0, bpl_plc=25.1, bpl_no_plc=4.3)
_CODECS: dict[str, _Codec] = {"G711": _G711, "G.711": _G711, "PCMU": _G711, "PCMA": _G711}


@dataclass(frozen=True, slots=True)
class EModelResult:
    """One E-model evaluation.

    Attributes:
        r: transmission rating factor R (G.107 eq. 7-1); may fall below 0 or, with a
            positive advantage factor, exceed 100.
        mos: estimated MOS_CQE on the 1..4.5 scale (G.107 Annex B).
        id: delay impairment Id = Idte + Idle + Idd (eq. 7-18).
        ie_eff: effective equipment impairment Ie,eff (eq. 7-29).
    """

    r: float
    mos: float
    id: float
    ie_eff: float


def _check_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def pure_delay_impairment(one_way_delay_ms: float) -> float:
    """Idd, the impairment of absolute delay alone (G.107 eqs. 7-27 and 7-28, sT = 1).

    ``Idd = 25 * ((1 + X^6)^(1/6) - 3 * (1 + (X/3)^6)^(1/6) + 2)`` with
    ``X = log2(Ta / 100)`` above mT = 100 ms, and 0 at or below it.
    """
    _check_finite("one_way_delay_ms", one_way_delay_ms)
    if one_way_delay_ms < 0:
        raise ValueError(f"one_way_delay_ms must be >= 0, got {one_way_delay_ms}")
    if one_way_delay_ms <= _MT:
        return 0.0
    x = math.log2(one_way_delay_ms / _MT)
    return 25.0 * ((1.0 + x**6) ** (1.0 / 6.0) - 3.0 * (1.0 + (x / 3.0) ** 6) ** (1.0 / 6.0) + 2.0)


def delay_impairment(one_way_delay_ms: float) -> float:
    """Id = Idte + Idle + Idd (G.107 eq. 7-18) at default echo settings, T = Ta, Tr = 2 Ta."""
    idd = pure_delay_impairment(one_way_delay_ms)  # also validates the delay
    t = one_way_delay_ms
    tr = 2.0 * t
    # Talker echo, eqs. 7-19 to 7-22. STMR = 15 dB lies in 9..20 dB, so neither the TERVs
    # variant (STMR < 9) nor Idtes (STMR > 20) of clause 7.4 applies.
    roe = -1.5 * (_NO - _RLR)  # eq. 7-20
    terv = _TELR - 40.0 * math.log10((1.0 + t / 10.0) / (1.0 + t / 150.0)) + 6.0 * math.exp(
        -0.3 * t**2
    )  # eq. 7-22
    re = 80.0 + 2.5 * (terv - 14.0)  # eq. 7-21
    idte = ((roe - re) / 2.0 + math.sqrt((roe - re) ** 2 / 4.0 + 100.0) - 1.0) * (
        1.0 - math.exp(-t)
    )  # eq. 7-19
    # Listener echo, eqs. 7-25 and 7-26.
    rle = 10.5 * (_WEPL + 7.0) * (tr + 1.0) ** -0.25  # eq. 7-26
    idle = (_RO - rle) / 2.0 + math.sqrt((_RO - rle) ** 2 / 4.0 + 169.0)  # eq. 7-25
    return idte + idle + idd


def ie_eff(
    packet_loss_pct: float, *, codec: str = "G711", plc: bool = True, burst_ratio: float = 1.0
) -> float:
    """Ie,eff = Ie + (95 - Ie) * Ppl / (Ppl / BurstR + Bpl) (G.107 eq. 7-29).

    ``packet_loss_pct`` is Ppl in percent (0..100); ``burst_ratio`` is BurstR: 1 for random
    loss, above 1 for bursty loss (G.107 clause 7.5).
    """
    _check_finite("packet_loss_pct", packet_loss_pct)
    _check_finite("burst_ratio", burst_ratio)
    if not 0.0 <= packet_loss_pct <= 100.0:
        raise ValueError(f"packet_loss_pct must be within 0..100, got {packet_loss_pct}")
    if burst_ratio <= 0:
        raise ValueError(f"burst_ratio must be > 0, got {burst_ratio}")
    try:
        params = _CODECS[codec.upper()]
    except KeyError:
        raise ValueError(
            f"no G.113 impairment values for codec {codec!r}; known: {', '.join(_CODECS)}"
        ) from None
    bpl = params.bpl_plc if plc else params.bpl_no_plc
    ppl = packet_loss_pct
    return params.ie + (95.0 - params.ie) * ppl / (ppl / burst_ratio + bpl)


def r_factor(
    one_way_delay_ms: float,
    packet_loss_pct: float,
    *,
    codec: str = "G711",
    plc: bool = True,
    burst_ratio: float = 1.0,
) -> float:
    """Transmission rating R = Ro - Is - Id - Ie,eff + A (G.107 eq. 7-1), A = 0.

    93.2 for an unimpaired G.711 call; see the module docstring for what is held at default.
    """
    return estimate(
        one_way_delay_ms, packet_loss_pct, codec=codec, plc=plc, burst_ratio=burst_ratio
    ).r


def mos_from_r(r: float) -> float:
    """MOS_CQE from R (G.107 Annex B, eq. B-4).

    1 for R < 0, 4.5 for R > 100, else ``1 + 0.035 R + R (R - 60)(100 - R) * 7e-6``. The
    cubic dips to 0.99 for 0 < R < 6.5 (its slope at 0 is -0.007); MOS has no value below 1
    on the ACR scale, so the result is held at 1 there, which keeps it monotonic in R.
    """
    _check_finite("r", r)
    if r < 0.0:
        return 1.0
    if r > 100.0:
        return 4.5
    return max(1.0, 1.0 + 0.035 * r + r * (r - 60.0) * (100.0 - r) * 7e-6)


def estimate(
    one_way_delay_ms: float,
    packet_loss_pct: float,
    *,
    codec: str = "G711",
    plc: bool = True,
    burst_ratio: float = 1.0,
) -> EModelResult:
    """R, MOS and the two impairments that vary, for one mouth-to-ear delay and loss rate.

    Args:
        one_way_delay_ms: mouth-to-ear delay Ta in ms (network, packetisation and jitter
            buffer together).
        packet_loss_pct: Ppl, lost or discarded packets in percent (0..100).
        codec: ``"G711"`` (also ``"G.711"``, ``"PCMU"``, ``"PCMA"``).
        plc: whether the receiver conceals lost packets (G.711 Appendix I).
        burst_ratio: BurstR (1 = random loss).

    Raises:
        ValueError: a negative or non-finite delay, a loss outside 0..100, a non-positive
            burst ratio, or a codec without G.113 values.
    """
    id_ = delay_impairment(one_way_delay_ms)
    ie = ie_eff(packet_loss_pct, codec=codec, plc=plc, burst_ratio=burst_ratio)
    r = DEFAULT_RO_MINUS_IS - id_ - ie + _A
    return EModelResult(r=r, mos=mos_from_r(r), id=id_, ie_eff=ie)
