//! What a peer declares on the wire cannot make its reader allocate more than an honest
//! frame of that kind takes. Each test measures the largest single allocation its own
//! thread made while reading (a global allocator that notes sizes per thread).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use freight_core::frame_io;
use freight_core::Error;
use freight_proto::frame::{self, Frame, FrameBuf, HEADER_LIMITS, MAX_CONTROL_HEADER, MAX_HEADER};

struct NotingSizes;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
}

// SAFETY: every call is passed on to the system allocator unchanged.
unsafe impl GlobalAlloc for NotingSizes {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        System.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOCATOR: NotingSizes = NotingSizes;

/// `f`'s result, and the largest allocation this thread made meanwhile.
fn largest_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|l| l.set(0));
    let out = f();
    (out, LARGEST.with(|l| l.get()))
}

fn limit(kind: &str) -> usize {
    HEADER_LIMITS.iter().find(|(k, _)| *k == kind).unwrap().1
}

/// The length prefix and first header byte of a `kind` frame declaring `n` bytes.
fn declared(n: usize, kind: &str) -> Vec<u8> {
    let mut b = (n as u32).to_le_bytes().to_vec();
    b.push(HEADER_LIMITS.iter().position(|(k, _)| *k == kind).unwrap() as u8);
    b
}

/// Zeros for ever after `prefix`: whoever believes the declared length gets all of it.
struct Endless(Vec<u8>, usize);

impl Read for Endless {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(1 << 20);
        for (i, b) in buf[..n].iter_mut().enumerate() {
            *b = self.0.get(self.1 + i).copied().unwrap_or(0);
        }
        self.1 += n;
        Ok(n)
    }
}

#[test]
fn a_declared_length_costs_nothing_when_refused() {
    // A data-stream frame declaring 100 MiB (under the protocol's overall bound).
    for kind in ["Write", "Read", "Notify", "WriteAck", "ReadData"] {
        let n = 100 << 20;
        assert!(n <= MAX_HEADER && n > limit(kind));
        let (r, largest) = largest_allocation(|| frame_io::read_frame(&mut Endless(declared(n, kind), 0)));
        assert!(matches!(r, Err(Error::Protocol(_))), "{kind}: {r:?}");
        assert!(largest < 4096, "{kind}: allocated {largest} bytes");
    }
    // The same prefix in a control connection's buffer.
    let mut buf = FrameBuf::new(MAX_CONTROL_HEADER);
    let (r, largest) = largest_allocation(|| {
        buf.extend(&declared(100 << 20, "Metadata"));
        buf.take()
    });
    assert!(matches!(r, Err(Error::Protocol(_))), "{r:?}");
    assert!(largest < 4096, "allocated {largest} bytes");
}

#[test]
fn a_segment_count_costs_no_more_than_the_header_it_came_in() {
    // As long as a write may be, declaring five million (3-byte, all-zero) segments:
    // decoding them all would take 120 MB.
    let n = limit("Write");
    let mut bytes = declared(n, "Write");
    bytes.push(0); // tag
    bytes.extend([0xc0, 0x96, 0xb1, 0x02]); // 5,000,000
    bytes.resize(4 + n, 0);
    let (r, largest) = largest_allocation(|| frame_io::read_frame(&mut &bytes[..]));
    assert!(matches!(&r, Err(Error::Protocol(m)) if m.contains("segments")), "{r:?}");
    assert!(largest <= n, "allocated {largest} bytes for a header of {n}");
    // Decoding alone (without `decode`'s look-ahead, which names the violation) stops at
    // the cap as well.
    let (r, largest) = largest_allocation(|| postcard::from_bytes::<Frame>(&bytes[4..]).is_err());
    assert!(r);
    assert!(largest < 64 << 10, "allocated {largest} bytes");
}

#[test]
fn looking_for_a_whole_frame_copies_none_of_it() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut writer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (mut reader, _) = listener.accept().unwrap();
    // Half of a 64 KiB notification: not there yet, however often one looks.
    let bytes = frame::encode(&Frame::Notify { msg: vec![1; 64 << 10] });
    let half = bytes.len() / 2;
    let sender = std::thread::spawn(move || {
        writer.write_all(&bytes[..half]).unwrap();
        (writer, bytes)
    });
    std::thread::sleep(Duration::from_millis(50));
    let (polls, largest) = largest_allocation(|| {
        (0..100).map(|_| frame_io::try_read_frame(&mut reader).unwrap()).filter(Option::is_some).count()
    });
    assert_eq!(polls, 0);
    assert!(largest < 4096, "allocated {largest} bytes to look");
    let (mut writer, bytes) = sender.join().unwrap();
    let rest = std::thread::spawn(move || writer.write_all(&bytes[half..]).unwrap());
    reader.set_nonblocking(false).unwrap();
    assert!(matches!(frame_io::read_frame(&mut reader).unwrap(), Some(Frame::Notify { msg }) if msg.len() == 64 << 10));
    rest.join().unwrap();
}
