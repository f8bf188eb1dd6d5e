//! SSE screening of an engine's OpenAI-chunks stream (pure: no I/O, no clock).
//!
//! The port of `orchestrator/gateway/failover.py` `SseRecorder.split` (whole events only, CRLF/CR line
//! ends relayed as LF) and `stream_protocol.py` `OpenAIChunks` + `bad_event` (every line an SSE field,
//! every data payload a JSON object or `[DONE]`, a choice or an error before `[DONE]`, nothing after it).
//! On top: the usage chunk (non-null `usage`, empty `choices`) is remembered and, with `strip_usage`,
//! withheld; content events are counted. The caller (relay.rs) feeds raw chunks and writes `out`.

use serde::de::IgnoredAny;
use serde_json::Value;

/// An incomplete event held longer than this is garbage.
pub const MAX_PENDING: usize = 1 << 20;
pub const NO_CHOICE: &str =
    "a stream that ended without any choice (every event had an empty choices list)";

#[derive(Default)]
pub struct Screener {
    pending: Vec<u8>,
    cr_end: bool,
    answered: bool,
    strip_usage: bool,
    /// `[DONE]` was relayed: the stream is complete (nothing more is screened).
    pub done: bool,
    /// The usage chunk's `usage`, as JSON text.
    pub usage: Option<String>,
    /// Content events relayed (`data: {…}` events other than the usage chunk).
    pub events: u64,
}

/// What one chunk gave: bytes to relay, and what happened.
#[derive(Default, Debug)]
pub struct Fed {
    pub out: Vec<u8>,
    /// complete data events screened (progress for the idle timer; the usage chunk counts)
    pub data_events: u32,
    /// content events relayed in `out`
    pub content_events: u32,
    pub done: bool,
    /// garbage: what was wrong (`out` holds the good events before it)
    pub problem: Option<String>,
}

enum Ev {
    Keep,
    Content,
    Usage(String),
    Done,
}

fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().map_or(true, |x| x != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

fn show(b: &[u8]) -> String {
    let n = b.len().min(60);
    format!("{:?}", String::from_utf8_lossy(&b[..n]))
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if from >= hay.len() {
        return None;
    }
    hay[from..].windows(needle.len()).position(|w| w == needle).map(|p| p + from)
}

fn rfind_blank(hay: &[u8]) -> Option<usize> {
    if hay.len() < 2 {
        return None;
    }
    (0..hay.len() - 1).rev().find(|&i| hay[i] == b'\n' && hay[i + 1] == b'\n')
}

fn trim(b: &[u8]) -> &[u8] {
    let s = b.iter().position(|c| !c.is_ascii_whitespace()).unwrap_or(b.len());
    let e = b.iter().rposition(|c| !c.is_ascii_whitespace()).map_or(s, |i| i + 1);
    &b[s..e.max(s)]
}

impl Screener {
    pub fn new(strip_usage: bool) -> Self {
        Screener { strip_usage, ..Default::default() }
    }

    /// Screen one raw chunk of the engine's body.
    pub fn feed(&mut self, chunk: &[u8]) -> Fed {
        let mut f = Fed::default();
        if self.done || chunk.is_empty() {
            return f;
        }
        let mut c: &[u8] = chunk;
        if self.cr_end {
            self.cr_end = false;
            if c.first() == Some(&b'\n') {
                c = &c[1..];
            }
        }
        let normalized;
        if c.contains(&b'\r') {
            self.cr_end = c.ends_with(b"\r");
            let mut v = Vec::with_capacity(c.len());
            let mut i = 0;
            while i < c.len() {
                if c[i] == b'\r' {
                    v.push(b'\n');
                    if i + 1 < c.len() && c[i + 1] == b'\n' {
                        i += 1;
                    }
                } else {
                    v.push(c[i]);
                }
                i += 1;
            }
            normalized = v;
            c = &normalized;
        }
        // fast path: nothing held and the chunk is whole events
        let whole: Vec<u8>;
        if self.pending.is_empty() && c.ends_with(b"\n\n") {
            whole = c.to_vec();
        } else {
            self.pending.extend_from_slice(c);
            match rfind_blank(&self.pending) {
                None => {
                    if self.pending.len() > MAX_PENDING {
                        f.problem = Some(format!(
                            "an event longer than {} bytes: {}",
                            MAX_PENDING,
                            show(&self.pending)
                        ));
                    }
                    return f;
                }
                Some(cut) => {
                    let rest = self.pending.split_off(cut + 2);
                    whole = std::mem::replace(&mut self.pending, rest);
                    if self.pending.len() > MAX_PENDING {
                        // (screened below first; the tail's size is a problem only if all before it was good)
                    }
                }
            }
        }
        self.screen_events(&whole, &mut f);
        if f.problem.is_none() && !f.done && self.pending.len() > MAX_PENDING {
            f.problem = Some(format!("an event longer than {} bytes: {}", MAX_PENDING, show(&self.pending)));
        }
        f
    }

    fn screen_events(&mut self, whole: &[u8], f: &mut Fed) {
        let n = whole.len();
        let mut start = 0;
        while start < n {
            let end = find(whole, b"\n\n", start).unwrap_or(n);
            let event = &whole[start..end];
            start = end + 2;
            if event.is_empty() {
                continue;
            }
            match self.event(event) {
                Err(p) => {
                    f.problem = Some(p);
                    return;
                }
                Ok(Ev::Keep) => push(&mut f.out, event),
                Ok(Ev::Content) => {
                    push(&mut f.out, event);
                    f.data_events += 1;
                    f.content_events += 1;
                    self.events += 1;
                }
                Ok(Ev::Usage(u)) => {
                    self.usage = Some(u);
                    f.data_events += 1;
                    if !self.strip_usage {
                        push(&mut f.out, event);
                    }
                }
                Ok(Ev::Done) => {
                    if !self.answered {
                        f.problem = Some(NO_CHOICE.to_string());
                        return;
                    }
                    push(&mut f.out, event);
                    f.data_events += 1;
                    f.done = true;
                    self.done = true;
                    self.pending.clear();
                    return;
                }
            }
        }
    }

    /// One whole event (no trailing blank line).
    fn event(&mut self, event: &[u8]) -> Result<Ev, String> {
        if event.starts_with(b"data: {") && !event.contains(&b'\n') {
            // the usual event: one JSON data line
            let payload = &event[6..];
            if self.answered && find(payload, b"\"usage\"", 0).is_none() {
                return match serde_json::from_slice::<IgnoredAny>(payload) {
                    Ok(_) => Ok(Ev::Content),
                    Err(_) => Err(format!("an event whose data is not JSON: {}", show(event))),
                };
            }
            return match serde_json::from_slice::<Value>(payload) {
                Ok(v) => Ok(self.object(&v)),
                Err(_) => Err(format!("an event whose data is not JSON: {}", show(event))),
            };
        }
        let mut data: Vec<&[u8]> = Vec::new();
        for line in event.split(|&b| b == b'\n') {
            if line.is_empty() {
                continue;
            }
            let field = [&b"data:"[..], b"event:", b"id:", b"retry:", b":"].iter().any(|p| line.starts_with(p));
            if !field {
                return Err(format!("bytes that are not server-sent events: {}", show(line)));
            }
            if line.starts_with(b"data:") {
                data.push(trim(&line[5..]));
            }
        }
        if data.is_empty() {
            return Ok(Ev::Keep); // a comment or an event name alone (keep-alive)
        }
        let payload = data.join(&b'\n');
        if payload == b"[DONE]" {
            return Ok(Ev::Done);
        }
        match serde_json::from_slice::<Value>(&payload) {
            Ok(v) if v.is_object() => Ok(self.object(&v)),
            _ => Err(format!("an event whose data is not a JSON object: {}", show(event))),
        }
    }

    fn object(&mut self, v: &Value) -> Ev {
        let choices = v.get("choices");
        if let Some(u) = v.get("usage") {
            if !u.is_null() && choices.and_then(|c| c.as_array()).map_or(false, |c| c.is_empty()) {
                return Ev::Usage(u.to_string());
            }
        }
        if !self.answered && (choices.map_or(false, truthy) || v.get("error").is_some()) {
            self.answered = true;
        }
        Ev::Content
    }
}

fn push(out: &mut Vec<u8>, event: &[u8]) {
    out.extend_from_slice(event);
    out.extend_from_slice(b"\n\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: &[u8] = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
    const U: &[u8] = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\n";
    const D: &[u8] = b"data: [DONE]\n\n";

    #[test]
    fn a_good_stream_passes_whole() {
        let mut s = Screener::new(false);
        let a = s.feed(C);
        assert_eq!(a.out, C);
        assert_eq!(a.content_events, 1);
        let b = s.feed(D);
        assert!(b.done && s.done);
        assert_eq!(b.out, D);
        assert!(s.feed(C).out.is_empty(), "nothing after [DONE]");
    }

    #[test]
    fn the_usage_chunk_is_remembered_and_withheld_when_asked() {
        let mut s = Screener::new(true);
        s.feed(C);
        let u = s.feed(U);
        assert!(u.out.is_empty());
        assert_eq!(u.data_events, 1);
        assert_eq!(s.usage.as_deref(), Some("{\"completion_tokens\":1,\"prompt_tokens\":3}"));
        assert_eq!(s.events, 1);
        let mut k = Screener::new(false);
        k.feed(C);
        assert_eq!(k.feed(U).out, U);
    }

    #[test]
    fn an_event_split_across_chunks_is_held_until_whole_and_crlf_is_accepted() {
        let mut s = Screener::new(false);
        let crlf: Vec<u8> = C.iter().flat_map(|&b| if b == b'\n' { vec![b'\r', b'\n'] } else { vec![b] }).collect();
        let (a, b) = crlf.split_at(crlf.len() - 1); // the chunk ends with "\r\n\r", the next starts "\n"
        assert!(s.feed(&a[..10]).out.is_empty());
        assert_eq!(s.feed(&a[10..]).out, C);
        assert!(s.feed(b).out.is_empty());
        let d = s.feed(b"data: [DO");
        assert!(d.out.is_empty());
        assert!(s.feed(b"NE]\r\n\r\n").done);
    }

    #[test]
    fn garbage_ends_with_the_good_events_before_it() {
        let mut s = Screener::new(false);
        let mut chunk = C.to_vec();
        chunk.extend_from_slice(b"data: {not json\n\n");
        let f = s.feed(&chunk);
        assert_eq!(f.out, C);
        assert!(f.problem.unwrap().contains("not JSON"));
        let mut s = Screener::new(false);
        assert!(s.feed(b"hello\n\n").problem.unwrap().contains("not server-sent events"));
        let mut s = Screener::new(false);
        assert!(s.feed(b"data: [1, 2]\n\n").problem.unwrap().contains("not a JSON object"));
    }

    #[test]
    fn done_without_a_choice_is_garbage() {
        let mut s = Screener::new(false);
        s.feed(U);
        let f = s.feed(D);
        assert!(f.out.is_empty() && !f.done);
        assert_eq!(f.problem.as_deref(), Some(NO_CHOICE));
        let mut e = Screener::new(false);
        e.feed(b"data: {\"error\": {\"message\": \"x\"}}\n\n");
        assert!(e.feed(D).done, "an error event answers");
    }

    #[test]
    fn comments_pass_and_a_huge_partial_event_is_garbage() {
        let mut s = Screener::new(false);
        let f = s.feed(b": ping\n\nevent: x\n\n");
        assert_eq!(f.out, b": ping\n\nevent: x\n\n");
        assert_eq!(f.data_events, 0);
        let big = vec![b'a'; MAX_PENDING + 1];
        let mut s = Screener::new(false);
        assert!(s.feed(b"data: {\"x\": \"").problem.is_none());
        assert!(s.feed(&big).problem.is_some());
    }
}
