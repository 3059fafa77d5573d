//! How a connection to an agent's listener is introduced, and what the listener makes
//! of it: the dialler sends a [`Frame::Hello`] built from its [`Introduction`]; the
//! listener judges it against its [`Gate`] and answers `Welcome`, `Metadata` or
//! `Refused`; the dialler reads that answer with [`dialler_reads`].
//!
//! Invariants (tested here and in [`crate::pair`]):
//! - without the agent's token, where it has one, nothing is answered but a refusal:
//!   not even the metadata, whose secret opens every other connection;
//! - secrets and tokens are compared in constant time ([`same_secret`]);
//! - a hello naming an earlier incarnation of the agent (stale metadata) is refused
//!   with a reason that says so, as is one of another protocol version.

use crate::error::{Error, Result};
use crate::frame::{Frame, Role, PROTOCOL_VERSION};

/// Who is calling and whom they expect to reach, with what proves that they may.
#[derive(Debug, Clone, Default)]
pub struct Introduction {
    pub from_name: String,
    pub from_id: u64,
    /// The target agent's id as the caller knows it from its metadata (0: not known
    /// yet, as for a metadata request).
    pub target_id: u64,
    /// The target's secret, from its metadata.
    pub secret: Vec<u8>,
    /// The target's access token, where it has one (empty otherwise).
    pub token: Vec<u8>,
}

impl Introduction {
    /// A request for the agent's metadata, which comes before its secret is known.
    pub fn for_metadata(token: &[u8]) -> Introduction {
        Introduction { token: token.to_vec(), ..Introduction::default() }
    }

    /// The hello that opens a connection for `role`.
    pub fn hello(&self, role: Role) -> Frame {
        Frame::Hello {
            version: PROTOCOL_VERSION,
            role,
            from_name: self.from_name.clone(),
            from_id: self.from_id,
            target_id: self.target_id,
            secret: self.secret.clone(),
            token: self.token.clone(),
        }
    }
}

/// What a listener requires of a hello.
#[derive(Debug, Clone, Copy)]
pub struct Gate<'a> {
    /// The listening agent's id (a hello naming another is stale).
    pub agent_id: u64,
    pub secret: &'a [u8],
    /// The token every connection must present, where the agent has one.
    pub token: Option<&'a [u8]>,
    /// Whether metadata requests are answered at all.
    pub serve_metadata: bool,
}

/// What the listener does with a connection, given its first frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Answer `Welcome` and serve the connection as `role` for the agent `from`.
    Admit { role: Role, from: String },
    /// Answer with the agent's metadata, then close.
    Metadata,
    /// Answer `Refused { reason }`, then close. `unauthenticated`: the caller lacked
    /// the token or secret, which an operator may want to hear of.
    Refuse { reason: String, unauthenticated: bool },
}

/// Judges a connection's first frame (`None`: it sent none).
pub fn judge(gate: &Gate<'_>, first: Option<Frame>) -> Verdict {
    let refuse = |reason: &str, unauthenticated| Verdict::Refuse { reason: reason.into(), unauthenticated };
    let Some(Frame::Hello { version, role, from_name, target_id, secret, token, .. }) = first else {
        return refuse("expected a hello", false);
    };
    if version != PROTOCOL_VERSION {
        return refuse(
            &format!("protocol version {version} is not supported (this agent speaks {PROTOCOL_VERSION})"),
            false,
        );
    }
    // The token first, whatever the connection is for: without it nothing is answered,
    // not even the metadata (whose secret opens the other connections).
    if let Some(required) = gate.token {
        if !same_secret(required, &token) {
            let why = if token.is_empty() { "no token was presented" } else { "the token presented is wrong" };
            return refuse(&format!("this agent requires a token and {why}"), true);
        }
    }
    if role == Role::Metadata {
        if !gate.serve_metadata {
            return refuse("this agent does not hand out its metadata on its listener", false);
        }
        return Verdict::Metadata;
    }
    if !same_secret(gate.secret, &secret) {
        return refuse("wrong secret", true);
    }
    if target_id != gate.agent_id {
        return refuse("stale metadata: this agent was restarted; fetch its metadata again", false);
    }
    Verdict::Admit { role, from: from_name }
}

/// The answer the listener sends for a verdict (`metadata`: the agent's, for
/// [`Verdict::Metadata`]).
pub fn answer(gate: &Gate<'_>, verdict: &Verdict, metadata: impl FnOnce() -> Vec<u8>) -> Frame {
    match verdict {
        Verdict::Admit { .. } => Frame::Welcome { agent_id: gate.agent_id },
        Verdict::Metadata => Frame::Metadata { bytes: metadata() },
        Verdict::Refuse { reason, .. } => Frame::Refused { reason: reason.clone() },
    }
}

/// What the dialler makes of the listener's answer to a hello for `role` (`None`: the
/// connection closed first): the metadata bytes for a metadata request, nothing for
/// another role, or why not. `to` names the listener in errors.
pub fn dialler_reads(role: Role, answer: Option<Frame>, to: &str) -> Result<Option<Vec<u8>>> {
    match (role, answer) {
        (Role::Metadata, Some(Frame::Metadata { bytes })) => Ok(Some(bytes)),
        (Role::Metadata, Some(Frame::Refused { reason })) => {
            Err(Error::Auth(format!("{to} refused the metadata request: {reason}")))
        }
        (Role::Metadata, Some(other)) => Err(Error::Protocol(format!("expected metadata, got {other:?}"))),
        (Role::Metadata, None) => Err(Error::Io(format!("{to} closed the connection without answering"))),
        (_, Some(Frame::Welcome { .. })) => Ok(None),
        (_, Some(Frame::Refused { reason })) => Err(Error::Auth(format!("{to} refused the connection: {reason}"))),
        (_, Some(other)) => Err(Error::Protocol(format!("expected a welcome, got {other:?}"))),
        (_, None) => Err(Error::Io(format!("{to} closed the connection during the handshake"))),
    }
}

/// Whether two secrets (tokens, keys) are equal, compared in time independent of where
/// they differ, so that one cannot be guessed byte by byte. Every secret of the project
/// is compared with this.
pub fn same_secret(a: &[u8], b: &[u8]) -> bool {
    subtle::ConstantTimeEq::ct_eq(a, b).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef";

    fn gate(token: Option<&'static [u8]>) -> Gate<'static> {
        Gate { agent_id: 7, secret: SECRET, token, serve_metadata: true }
    }

    fn intro(token: &[u8]) -> Introduction {
        Introduction { from_name: "a".into(), from_id: 3, target_id: 7, secret: SECRET.to_vec(), token: token.to_vec() }
    }

    #[test]
    fn a_right_hello_is_admitted_for_its_role_and_welcomed() {
        for role in [Role::Control, Role::Data { index: 2 }, Role::Fabric] {
            let v = judge(&gate(None), Some(intro(b"").hello(role)));
            assert_eq!(v, Verdict::Admit { role, from: "a".into() });
            let answer = answer(&gate(None), &v, || unreachable!("no metadata for {role:?}"));
            assert_eq!(dialler_reads(role, Some(answer), "x").unwrap(), None);
        }
    }

    #[test]
    fn without_the_token_nothing_is_answered_not_even_the_metadata() {
        let g = gate(Some(b"token"));
        for (presented, why) in [(&b""[..], "no token was presented"), (b"tokem", "the token presented is wrong")] {
            for role in [Role::Metadata, Role::Control, Role::Data { index: 0 }] {
                let v = judge(&g, Some(intro(presented).hello(role)));
                assert!(
                    matches!(&v, Verdict::Refuse { reason, unauthenticated: true } if reason.contains(why)),
                    "{v:?}"
                );
                let e = dialler_reads(role, Some(answer(&g, &v, Vec::new)), "x").unwrap_err();
                assert!(matches!(&e, Error::Auth(m) if m.contains(why)), "{e}");
            }
        }
        let md = judge(&g, Some(Introduction::for_metadata(b"token").hello(Role::Metadata)));
        assert_eq!(md, Verdict::Metadata);
        assert_eq!(dialler_reads(Role::Metadata, Some(answer(&g, &md, || vec![1, 2])), "x").unwrap(), Some(vec![1, 2]));
    }

    #[test]
    fn a_wrong_secret_stale_metadata_and_another_version_are_refused_with_their_reasons() {
        let g = gate(None);
        let mut wrong = intro(b"");
        wrong.secret = b"0123456789abcdeF".to_vec();
        assert!(matches!(judge(&g, Some(wrong.hello(Role::Control))),
            Verdict::Refuse { reason, unauthenticated: true } if reason == "wrong secret"));
        let mut stale = intro(b"");
        stale.target_id = 6;
        assert!(matches!(judge(&g, Some(stale.hello(Role::Control))),
            Verdict::Refuse { reason, unauthenticated: false } if reason.contains("stale metadata")));
        let Frame::Hello { role, from_name, from_id, target_id, secret, token, .. } = intro(b"").hello(Role::Control)
        else {
            unreachable!()
        };
        let old = Frame::Hello { version: PROTOCOL_VERSION - 1, role, from_name, from_id, target_id, secret, token };
        assert!(matches!(judge(&g, Some(old)), Verdict::Refuse { reason, .. } if reason.contains("not supported")));
        assert!(matches!(judge(&g, Some(Frame::Wake)), Verdict::Refuse { reason, .. } if reason == "expected a hello"));
        assert!(matches!(judge(&g, None), Verdict::Refuse { .. }));
        // A metadata request needs no secret, but an agent may refuse to serve it.
        let closed = Gate { serve_metadata: false, ..g };
        assert!(matches!(judge(&closed, Some(Introduction::for_metadata(b"").hello(Role::Metadata))),
            Verdict::Refuse { reason, unauthenticated: false } if reason.contains("does not hand out")));
    }

    #[test]
    fn the_dialler_reads_anything_but_its_answer_as_a_violation_or_a_closed_connection() {
        assert!(matches!(dialler_reads(Role::Control, Some(Frame::Wake), "x"), Err(Error::Protocol(_))));
        assert!(matches!(dialler_reads(Role::Control, None, "x"), Err(Error::Io(_))));
        assert!(matches!(
            dialler_reads(Role::Metadata, Some(Frame::Welcome { agent_id: 1 }), "x"),
            Err(Error::Protocol(_))
        ));
        assert!(matches!(dialler_reads(Role::Metadata, None, "x"), Err(Error::Io(_))));
    }

    #[test]
    fn secrets_compare_equal_only_when_equal() {
        assert!(same_secret(b"abc", b"abc"));
        assert!(!same_secret(b"abc", b"abd") && !same_secret(b"abc", b"ab") && !same_secret(b"", b"a"));
        assert!(same_secret(b"", b""));
    }
}
