//! How a batch of objects is laid out in pipe messages: pure arithmetic, kept apart
//! from I/O so that it is property-tested.
//!
//! Objects go into messages in order, each at an aligned offset. A message is at most
//! `max_message` bytes. An object that does not fit in what is left of the current
//! message starts a new one; an object larger than a whole message is cut into parts
//! that fill messages one after another (the receiver reassembles them).

use crate::pipe::ALIGN;

/// One run of an object's bytes in a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Index of the object in the batch.
    pub object: usize,
    /// Where the run starts in the object.
    pub object_at: u64,
    /// Where the run starts in the message.
    pub offset: u64,
    pub len: u64,
}

fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN) * ALIGN
}

/// The messages for objects of these sizes (each a list of pieces). Empty objects take
/// a zero-length piece, so that their keys still travel. `max_message` is at least
/// [`ALIGN`].
pub fn plan(sizes: &[u64], max_message: u64) -> Vec<Vec<Piece>> {
    assert!(max_message >= ALIGN, "messages must hold at least {ALIGN} bytes");
    let mut messages: Vec<Vec<Piece>> = Vec::new();
    let mut current: Vec<Piece> = Vec::new();
    let mut used = 0u64; // end of the last piece in the current message
    for (object, &size) in sizes.iter().enumerate() {
        let mut at = 0u64;
        loop {
            let offset = align_up(used);
            let room = max_message.saturating_sub(offset);
            let left = size - at;
            // Start afresh when the rest would fit a new message but not this one, or
            // when this one has no room at all.
            if !current.is_empty() && (room == 0 || (left > room && left <= max_message)) {
                messages.push(std::mem::take(&mut current));
                used = 0;
                continue;
            }
            let len = left.min(room);
            current.push(Piece { object, object_at: at, offset, len });
            used = offset + len;
            at += len;
            if at == size {
                break;
            }
        }
    }
    if !current.is_empty() {
        messages.push(current);
    }
    messages
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn small_objects_share_messages_and_large_ones_are_cut() {
        let p = |object, object_at, offset, len| Piece { object, object_at, offset, len };
        assert_eq!(
            plan(&[100, 100, 1000], 512),
            vec![vec![p(0, 0, 0, 100), p(1, 0, 256, 100)], vec![p(2, 0, 0, 512)], vec![p(2, 512, 0, 488)],]
        );
        // A large object starts in the room left by small ones.
        assert_eq!(
            plan(&[10, 1000], 512),
            vec![vec![p(0, 0, 0, 10), p(1, 0, 256, 256)], vec![p(1, 256, 0, 512)], vec![p(1, 768, 0, 232)],]
        );
    }

    #[test]
    fn an_object_that_fits_a_message_is_never_cut() {
        let m = plan(&[300, 400], 512);
        assert_eq!(
            m,
            vec![
                vec![Piece { object: 0, object_at: 0, offset: 0, len: 300 }],
                vec![Piece { object: 1, object_at: 0, offset: 0, len: 400 }],
            ]
        );
        let m = plan(&[0, 5], 256);
        assert_eq!(
            m,
            vec![vec![
                Piece { object: 0, object_at: 0, offset: 0, len: 0 },
                Piece { object: 1, object_at: 0, offset: 0, len: 5 },
            ]]
        );
    }

    proptest! {
        #[test]
        fn every_byte_is_placed_once_within_bounds(
            sizes in prop::collection::vec(0u64..5000, 1..30),
            max in 256u64..4096,
        ) {
            let messages = plan(&sizes, max);
            let mut covered = vec![0u64; sizes.len()];
            for m in &messages {
                prop_assert!(!m.is_empty());
                let mut end = 0;
                for p in m {
                    prop_assert_eq!(p.offset % ALIGN, 0);
                    prop_assert!(p.offset >= end, "pieces overlap");
                    prop_assert!(p.offset + p.len <= max, "a piece runs past the message");
                    prop_assert_eq!(p.object_at, covered[p.object], "pieces of an object come in order");
                    covered[p.object] += p.len;
                    end = p.offset + p.len;
                }
            }
            prop_assert_eq!(&covered, &sizes);
            for (i, &s) in sizes.iter().enumerate() {
                let parts = messages.iter().flatten().filter(|p| p.object == i).count();
                if s <= max {
                    prop_assert_eq!(parts, 1, "object {} of {} bytes was cut", i, s);
                }
            }
        }
    }
}
