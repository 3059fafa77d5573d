//! Why a kernel gave up: the status word the kernels leave in host memory, decoded into
//! an engine error. Pure, so every case is tested without a GPU.

use freight_core::Error;

/// Top byte of the status word (kernels.cu's `STATUS_*`).
const TIMEOUT: u64 = 1;
const ABORTED: u64 = 2;
const BAD_EXPERT: u64 = 3;
const DUPLICATE_EXPERT: u64 = 4;
const FORMAT_MISMATCH: u64 = 5;

/// The value an abort reports (the abort word less one, in the status word's low 48
/// bits) when the rendezvous was lost rather than a rank: no rank number comes near it.
pub const RENDEZVOUS_LOST: u64 = 0xffff_ffff_ffff;

/// The wait a kernel gave up in (kernels.cu's signal kinds).
fn wait_name(what: u64) -> &'static str {
    match what {
        0 => "dispatch rows to arrive",
        1 => "a peer to release its dispatch rows",
        2 => "combine rows to arrive",
        3 => "a peer to release its combine rows",
        _ => "an unknown signal",
    }
}

/// The error a non-zero status word stands for (`None` for 0).
pub fn decode(word: u64, timeout_s: f64) -> Option<Error> {
    if word == 0 {
        return None;
    }
    let (code, what, value) = (word >> 56, (word >> 48) & 0xff, word & 0xffff_ffff_ffff);
    Some(match code {
        TIMEOUT => Error::Timeout(format!(
            "rank {value} did not signal within {timeout_s} s while this rank waited for {}; is it alive and running the same sequence of calls?",
            wait_name(what)
        )),
        ABORTED if value == RENDEZVOUS_LOST => Error::PeerDisconnected {
            peer: "rendezvous".into(),
            reason: format!(
                "lost while this rank waited for {}: no rank's death can be learnt any more",
                wait_name(what)
            ),
        },
        ABORTED => Error::PeerDisconnected {
            peer: format!("rank {value}"),
            reason: format!("found dead while this rank waited for {}", wait_name(what)),
        },
        BAD_EXPERT => {
            Error::InvalidArgument(format!("token {value} chose an expert index outside [-1, number of experts)"))
        }
        DUPLICATE_EXPERT => Error::InvalidArgument(format!("token {value} chose the same expert twice in its top-k")),
        FORMAT_MISMATCH => Error::InvalidArgument(format!(
            "rank {value} dispatched its tokens in another format than this rank (fp8 against bf16): every rank must pass the same fp8 to a dispatch"
        )),
        _ => Error::Protocol(format!("unknown kernel status {word:#x}")),
    })
}

/// The error for an abort word (a death hook's report: the dead rank plus one, or
/// [`RENDEZVOUS_LOST`] plus one) read before a call is queued; `None` for 0.
pub fn dead_before_call(abort: u64) -> Option<Error> {
    match abort {
        0 => None,
        w if w == RENDEZVOUS_LOST + 1 => Some(Error::PeerDisconnected {
            peer: "rendezvous".into(),
            reason: "lost before this call: no rank's death can be learnt any more".into(),
        }),
        w => Some(Error::PeerDisconnected {
            peer: format!("rank {}", w - 1),
            reason: "found dead before this call was queued".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn word(code: u64, what: u64, value: u64) -> u64 {
        (code << 56) | (what << 48) | value
    }

    #[test]
    fn each_status_becomes_the_matching_error() {
        assert_eq!(decode(0, 1.0), None);
        match decode(word(TIMEOUT, 2, 3), 5.0) {
            Some(Error::Timeout(m)) => assert!(m.contains("rank 3") && m.contains("combine rows to arrive"), "{m}"),
            other => panic!("{other:?}"),
        }
        match decode(word(ABORTED, 0, 2), 5.0) {
            Some(Error::PeerDisconnected { peer, .. }) => assert_eq!(peer, "rank 2"),
            other => panic!("{other:?}"),
        }
        match decode(word(ABORTED, 1, RENDEZVOUS_LOST), 5.0) {
            Some(Error::PeerDisconnected { peer, reason }) => {
                assert_eq!(peer, "rendezvous");
                assert!(reason.contains("release its dispatch rows"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        match decode(word(BAD_EXPERT, 0, 17), 5.0) {
            Some(Error::InvalidArgument(m)) => assert!(m.contains("token 17")),
            other => panic!("{other:?}"),
        }
        match decode(word(DUPLICATE_EXPERT, 0, 4), 5.0) {
            Some(Error::InvalidArgument(m)) => assert!(m.contains("same expert twice")),
            other => panic!("{other:?}"),
        }
        match decode(word(FORMAT_MISMATCH, 0, 1), 5.0) {
            Some(Error::InvalidArgument(m)) => assert!(m.contains("rank 1") && m.contains("fp8"), "{m}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(decode(word(9, 0, 0), 5.0), Some(Error::Protocol(_))));
    }

    #[test]
    fn a_death_learnt_between_calls_names_the_rank_or_the_rendezvous() {
        assert_eq!(dead_before_call(0), None);
        match dead_before_call(3) {
            Some(Error::PeerDisconnected { peer, .. }) => assert_eq!(peer, "rank 2"),
            other => panic!("{other:?}"),
        }
        match dead_before_call(RENDEZVOUS_LOST + 1) {
            Some(Error::PeerDisconnected { peer, .. }) => assert_eq!(peer, "rendezvous"),
            other => panic!("{other:?}"),
        }
    }
}
