//! Frames on sockets: reading a frame's header (bounded before anything is allocated,
//! see [`frame::declared_len`]), writing a header with its payload in as few system
//! calls as the kernel allows, and the vectored reads and writes payloads take. The
//! format itself is [`freight_proto::frame`]'s.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;

use freight_proto::error::{Error, Result};
use freight_proto::frame::{self, Frame, MAX_HEADER};

/// Reads one frame header. `Ok(None)` on a clean end of stream before any byte.
pub fn read_frame(r: &mut impl Read) -> Result<Option<Frame>> {
    read_frame_within(r, MAX_HEADER)
}

/// [`read_frame`] for a frame whose header may take at most `most` bytes.
pub fn read_frame_within(r: &mut impl Read, most: usize) -> Result<Option<Frame>> {
    // The length, then the header's first byte (the frame's kind), usually in one read.
    // Both are checked before anything is allocated for the rest.
    let mut head = [0u8; 5];
    let mut got = 0;
    let n = loop {
        match r.read(&mut head[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(Error::Io("connection closed inside a frame".into())),
            Ok(k) => got += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        }
        match frame::declared_len(&head[..got], most)? {
            Some(0) => return frame::decode(&[]).map(Some),
            Some(n) => break n,
            None => continue,
        }
    };
    let mut buf = vec![0u8; n];
    buf[0] = head[4];
    r.read_exact(&mut buf[1..])?;
    frame::decode(&buf).map(Some)
}

/// Reads one frame header from `sock` if the whole of it has arrived already, without
/// ever blocking (for a server with other work to do meanwhile). `Ok(None)`: not all of
/// it is there yet (or the peer closed; the next blocking read says so).
pub fn try_read_frame(sock: &mut TcpStream) -> Result<Option<Frame>> {
    let mut head = [0u8; 5];
    let got = peek_now(sock, &mut head)?;
    // What `read_frame` refuses from the length alone, or from the kind once it is here,
    // it refuses without waiting for more.
    match frame::declared_len(&head[..got], MAX_HEADER) {
        Ok(None) => return Ok(None),
        Ok(Some(n)) if n > 0 && received(sock)? < 4 + n => return Ok(None),
        _ => {}
    }
    // All there, or refused: this read does not block.
    read_frame(sock)
}

/// Bytes received on `sock` and not read yet (nothing is copied or allocated).
fn received(sock: &TcpStream) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int; the descriptor is the socket's.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::FIONREAD, &mut n) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n.max(0) as usize)
}

/// Copies what has arrived, up to `buf.len()` bytes, without taking it off the socket.
fn peek_now(sock: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of its length; the descriptor is the socket's.
    let n = unsafe {
        libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_PEEK | libc::MSG_DONTWAIT)
    };
    if n >= 0 {
        return Ok(n as usize);
    }
    match io::Error::last_os_error() {
        e if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => Ok(0),
        e => Err(e),
    }
}

/// Writes a frame header followed by `payload`, with as few syscalls as the kernel allows.
pub fn write_frame(w: &mut impl Write, frame: &Frame, payload: &[IoSlice<'_>]) -> Result<()> {
    let header = frame::encode(frame);
    let mut slices = Vec::with_capacity(payload.len() + 1);
    slices.push(IoSlice::new(&header));
    slices.extend_from_slice(payload);
    write_all_vectored(w, &mut slices)?;
    Ok(())
}

/// `write_all` for a list of slices (std's version is unstable).
pub fn write_all_vectored(w: &mut impl Write, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        match w.write_vectored(slices) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "connection closed while writing")),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `read_exact` into a list of slices: one `readv` per kernel wake-up, not per slice.
pub fn read_exact_vectored(r: &mut impl Read, mut slices: &mut [IoSliceMut<'_>]) -> io::Result<()> {
    IoSliceMut::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        match r.read_vectored(slices) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed inside a payload")),
            Ok(n) => IoSliceMut::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads and discards `n` payload bytes (a refused write must still be drained).
pub fn discard(r: &mut impl Read, n: u64) -> io::Result<()> {
    let copied = io::copy(&mut r.take(n), &mut io::sink())?;
    if copied < n {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed inside a payload"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use freight_proto::frame::{encode, Seg, HEADER_LIMITS, MAX_HELLO, MAX_NOTIF};
    use freight_proto::metadata::HostIdentity;

    #[test]
    fn a_frame_is_read_without_blocking_only_once_all_of_it_arrived() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut writer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut reader, _) = listener.accept().unwrap();
        let first = Frame::Read { tag: 7, segs: vec![Seg { region: 1, addr: 4096, len: 1 << 20 }] };
        let bytes = encode(&first);
        let settle = || std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(try_read_frame(&mut reader).unwrap(), None, "nothing sent yet");
        for cut in [2, bytes.len() - 1] {
            writer.write_all(&bytes[..cut]).unwrap();
            settle();
            assert_eq!(try_read_frame(&mut reader).unwrap(), None, "{cut} of {} bytes", bytes.len());
            writer.write_all(&bytes[cut..]).unwrap();
            settle();
            assert_eq!(try_read_frame(&mut reader).unwrap(), Some(first.clone()));
        }
        // Nothing was taken early: the frame after it reads whole, by blocking read too.
        let second = Frame::WriteAck { tag: 8, error: None };
        writer.write_all(&encode(&second)).unwrap();
        assert_eq!(read_frame(&mut reader).unwrap(), Some(second));
        writer.write_all(&(MAX_HEADER as u32 + 1).to_le_bytes()).unwrap();
        settle();
        assert!(matches!(try_read_frame(&mut reader), Err(Error::Protocol(_))));
    }

    #[test]
    fn a_frame_too_long_for_its_kind_is_refused_without_waiting_for_it() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut writer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut reader, _) = listener.accept().unwrap();
        let settle = || std::thread::sleep(std::time::Duration::from_millis(50));
        // A frame that arrives in pieces is waited for (the whole of it fits in the
        // socket's buffers: it is only ever peeked at until it is all there).
        let big = Frame::Notify { msg: vec![7; 32 << 10] };
        let bytes = encode(&big);
        let half = bytes.len() / 2;
        let sender = std::thread::spawn(move || {
            writer.write_all(&bytes[..half]).unwrap();
            settle();
            writer.write_all(&bytes[half..]).unwrap();
            writer
        });
        let mut polls = 0;
        let got = loop {
            match try_read_frame(&mut reader).unwrap() {
                Some(f) => break f,
                None => polls += 1,
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        assert_eq!(got, big);
        assert!(polls > 0, "the second half came later");
        let mut writer = sender.join().unwrap();
        // A read longer than any read: refused once its kind is known.
        writer.write_all(&declared(HEADER_LIMITS[5].1 + 1, "Read")).unwrap();
        settle();
        assert!(matches!(try_read_frame(&mut reader), Err(Error::Protocol(m)) if m.contains("Read")));
    }

    #[test]
    fn frames_roundtrip_with_payload() {
        let f = Frame::Write {
            tag: 9,
            segs: vec![Seg { region: 1, addr: 0x10, len: 3 }, Seg { region: 1, addr: 0x20, len: 2 }],
            notif: Some(b"layer 3 done".to_vec()),
        };
        let mut buf = Vec::new();
        write_frame(&mut buf, &f, &[IoSlice::new(b"abc"), IoSlice::new(b"de")]).unwrap();
        let mut r = &buf[..];
        let got = read_frame(&mut r).unwrap().unwrap();
        assert_eq!(got, f);
        assert_eq!(got.payload_len().unwrap(), 5);
        let (mut a, mut b) = ([0u8; 3], [0u8; 2]);
        read_exact_vectored(&mut r, &mut [IoSliceMut::new(&mut a), IoSliceMut::new(&mut b)]).unwrap();
        assert_eq!((&a, &b), (b"abc", b"de"));
        assert!(read_frame(&mut r).unwrap().is_none());
    }

    #[test]
    fn hostile_sizes_are_refused_and_a_cut_frame_is_an_error() {
        let mut huge = (u32::MAX).to_le_bytes().to_vec();
        huge.extend_from_slice(&[0; 8]);
        assert!(matches!(read_frame(&mut &huge[..]), Err(Error::Protocol(_))));
        let big = encode(&Frame::Notify { msg: vec![0; MAX_NOTIF + 1] });
        assert!(matches!(read_frame(&mut &big[..]), Err(Error::Protocol(_))));
        // A frame cut anywhere is an error, not a hang or a panic; nothing at all is the
        // clean end of the stream.
        let bytes = encode(&Frame::Outbox {
            host: HostIdentity { hostname: "h".into(), boot_id: "b".into(), pid_namespace: 1, pid: 2 },
            fd: 3,
            len: 4096,
        });
        assert!(matches!(read_frame(&mut &bytes[..0]), Ok(None)));
        for cut in 1..bytes.len() {
            assert!(read_frame(&mut &bytes[..cut]).is_err(), "cut at {cut}");
        }
        assert!(read_frame(&mut &bytes[..]).unwrap().is_some());
    }

    /// A stream that holds `prefix` and then fails: a reader that gets past the prefix
    /// (to allocate for and read a header) reports an I/O error, not a protocol one.
    struct Prefix<'a>(&'a [u8]);

    impl Read for Prefix<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.0.is_empty() {
                return Err(io::Error::other("read past the prefix"));
            }
            self.0.read(buf)
        }
    }

    /// The 5 bytes that declare a header of `n` bytes of the given kind.
    fn declared(n: usize, kind: &str) -> Vec<u8> {
        let mut b = (n as u32).to_le_bytes().to_vec();
        b.push(HEADER_LIMITS.iter().position(|(k, _)| *k == kind).unwrap() as u8);
        b
    }

    #[test]
    fn a_declared_length_over_its_kinds_limit_is_refused_before_reading_it() {
        for kind in ["Write", "Read", "Notify", "WriteAck", "Wake", "Outbox", "FabricKeys"] {
            let limit = HEADER_LIMITS.iter().find(|(k, _)| *k == kind).unwrap().1;
            let e = read_frame(&mut Prefix(&declared(limit + 1, kind))).unwrap_err();
            assert!(matches!(&e, Error::Protocol(m) if m.contains(kind)), "{kind}: {e}");
        }
        // Within its limit, the reader goes on to read the header.
        let e = read_frame(&mut Prefix(&declared(1000, "Read"))).unwrap_err();
        assert!(matches!(e, Error::Io(_)), "{e}");
        // An unknown kind is refused at once too.
        let e = read_frame(&mut Prefix(&[9, 0, 0, 0, 200])).unwrap_err();
        assert!(matches!(e, Error::Protocol(_)), "{e}");
        // A hello is held to what an unauthenticated connection may send.
        let e = read_frame_within(&mut Prefix(&declared(MAX_HELLO + 1, "Hello")), MAX_HEADER).unwrap_err();
        assert!(matches!(e, Error::Protocol(_)), "{e}");
    }
}
