//! Compact binary encoding of ledger records (commands) and snapshots (the whole gate state).
//! Hand-written so the format is ours, versioned and stable; decoding never panics on any input.
//! Byte layout: docs/LEDGER.md, "Record payloads" and "Compaction records and snapshot payloads".

use crate::command::{
    Admit, Command, PolicyDecision, Record, RunLimits, SagaAction, SagaStep, Spend, Token,
    TokenAction, TokenChange,
};
use crate::gate::Gate;
use crate::ids::{
    Digest, EffectKey, IdError, Part, Principal, PrincipalName, Role, RunId, ToolName,
};
use crate::limits::Limits;
use crate::runs::Runs;
use crate::state::{
    Approval, Approver, Compensation, Effect, EffectSpend, Interner, OutcomeRecord, Run, Status,
    Stop, Tombstone,
};
use crate::tombstones::Tombstones;
use crate::vocab::{
    Decision, EffectClass, EffectStatus, HoldReason, Outcome, PolicyAction, RefusalReason,
    Reversibility, RunState, StopCause,
};
use std::collections::{BTreeMap, BTreeSet};

/// Version byte at the start of every record payload. New shapes of a command get a new tag
/// (older tags are still read and still written when the new fields are absent), so the version
/// has not moved: an admission with a model budget or reservation is tag `SPEND_ADMIT_TAG`, a
/// completion with a cost `SPEND_COMPLETE_TAG` (docs/LEDGER.md).
pub const RECORD_VERSION: u8 = 1;
/// An admission whose run limits name a model budget or which carries a reservation: the tag,
/// then the admission's own tag (1, 17, 18 or 20) and body as before, then the spend trailer
/// (`max_spend`, `max_tokens` as optional u64s; the reservation's micro-USD and tokens).
const SPEND_ADMIT_TAG: u8 = 32;
/// A completion with a cost: tag 4's body, then the cost's micro-USD and tokens.
const SPEND_COMPLETE_TAG: u8 = 33;
/// A command sent by a part of its principal other than `Part::Main` (the egress supervisor of
/// a sandbox): the tag and the part's index in `Part::ALL`, then the command as it is written
/// otherwise (its own tag first). Records of `Part::Main`, and every record written before
/// parts existed, have none.
const PART_TAG: u8 = 34;
/// Version byte at the start of every snapshot. 2: runs lost their `compacted` byte (retention
/// forgets a run instead) and the tombstones follow the runs.
/// 3: each effect ends with its compensation (the reverse saga). Versions 1 and 2 are still
/// read (their effects have none).
/// 4: each effect also has its `lookup` tool, and its compensation the lookups and whether an
/// operator chose it. Version 3 is still read (no lookup; one lookup granted; not chosen).
/// 5: each compensation ends with the approval its compensating call waits for, if any.
/// Version 4 is still read (none).
/// 6: each effect ends with its model spend, and each run with its model budget (`max_spend`,
/// `max_tokens`) and what its subtree spent and has reserved. Version 5 is still read (none).
/// 7: each effect's `lookup` is followed by its `lookup_args` (CEL text), if any. Version 6
/// is still read (none).
/// 8: each effect ends with the part that holds it (`Effect::holder`, its index in
/// `Part::ALL`) and its count of refused contradicting completions (`Effect::disputes`).
/// Version 7 is still read (`Part::Main`, none).
pub const SNAPSHOT_VERSION: u8 = 8;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot decode {what} at byte {offset}: {problem}")]
pub struct CodecError {
    pub what: &'static str,
    pub offset: usize,
    pub problem: String,
}

struct W<'a>(&'a mut Vec<u8>);

impl W<'_> {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bool(&mut self, v: bool) {
        self.u8(u8::from(v));
    }
    fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.0.extend_from_slice(s.as_bytes());
    }
    fn opt_str(&mut self, s: Option<&str>) {
        match s {
            None => self.u8(0),
            Some(s) => {
                self.u8(1);
                self.str(s);
            }
        }
    }
    fn opt_u64(&mut self, v: Option<u64>) {
        match v {
            None => self.u8(0),
            Some(v) => {
                self.u8(1);
                self.u64(v);
            }
        }
    }
    fn strs(&mut self, v: &[Box<str>]) {
        self.u32(v.len() as u32);
        for s in v {
            self.str(s);
        }
    }
    fn digest(&mut self, d: &Digest) {
        self.0.extend_from_slice(&d.0);
    }
}

struct R<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> R<'a> {
    fn err(&self, problem: impl Into<String>) -> CodecError {
        CodecError {
            what: self.what,
            offset: self.pos,
            problem: problem.into(),
        }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], CodecError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| self.err("truncated"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, CodecError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, CodecError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, CodecError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn bool(&mut self) -> Result<bool, CodecError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.err(format!("bad bool {b}"))),
        }
    }
    /// A string's bytes, not yet checked.
    fn raw_str(&mut self) -> Result<&'a [u8], CodecError> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn str(&mut self) -> Result<&'a str, CodecError> {
        let b = self.raw_str()?;
        std::str::from_utf8(b).map_err(|_| self.err("invalid utf-8"))
    }
    /// Whether the next string is `s`; on `false` the position is where it was.
    fn next_str_is(&mut self, s: &str) -> bool {
        let start = self.pos;
        if self.raw_str().is_ok_and(|b| b == s.as_bytes()) {
            return true;
        }
        self.pos = start;
        false
    }
    fn boxed(&mut self) -> Result<Box<str>, CodecError> {
        Ok(self.str()?.into())
    }
    fn opt<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<T, CodecError>,
    ) -> Result<Option<T>, CodecError> {
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(f(self)?)),
            b => Err(self.err(format!("bad option tag {b}"))),
        }
    }
    fn count(&mut self, min_item_bytes: usize) -> Result<usize, CodecError> {
        let n = self.u32()? as usize;
        // A hostile count cannot make us allocate more than the bytes that remain could hold.
        if n.saturating_mul(min_item_bytes.max(1)) > self.buf.len() - self.pos {
            return Err(self.err(format!("count {n} exceeds the remaining bytes")));
        }
        Ok(n)
    }
    fn strs(&mut self) -> Result<Vec<Box<str>>, CodecError> {
        let n = self.count(4)?;
        // A loop, not `collect` over `Result`s: most lists are empty, and this is per record.
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(self.boxed()?);
        }
        Ok(v)
    }
    fn digest(&mut self) -> Result<Digest, CodecError> {
        let mut d = [0u8; 32];
        d.copy_from_slice(self.take(32)?);
        Ok(Digest(d))
    }
    fn id<T>(&mut self, f: fn(&str) -> Result<T, IdError>) -> Result<T, CodecError> {
        let s = self.str()?;
        f(s).map_err(|e| self.err(e.to_string()))
    }
    fn run(&mut self) -> Result<RunId, CodecError> {
        self.id(RunId::new)
    }
    fn key(&mut self) -> Result<EffectKey, CodecError> {
        let start = self.pos;
        if let Some(key) = self
            .raw_str()
            .ok()
            .and_then(EffectKey::from_short_printable)
        {
            return Ok(key);
        }
        self.pos = start;
        self.id(EffectKey::new)
    }
    fn tool(&mut self) -> Result<ToolName, CodecError> {
        self.id(ToolName::new)
    }
    fn principal_name(&mut self) -> Result<PrincipalName, CodecError> {
        self.id(PrincipalName::new)
    }
    fn enum_of<T: Copy>(&mut self, all: &[T]) -> Result<T, CodecError> {
        let i = self.u8()? as usize;
        all.get(i)
            .copied()
            .ok_or_else(|| self.err(format!("bad enum index {i}")))
    }
    fn done(&self) -> Result<(), CodecError> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(self.err(format!("{} trailing bytes", self.buf.len() - self.pos)))
        }
    }
}

fn idx<T: PartialEq>(all: &[T], v: &T) -> u8 {
    all.iter()
        .position(|x| x == v)
        .expect("vocabulary value is in ALL") as u8
}

fn role_byte(r: Role) -> u8 {
    match r {
        Role::Agent => 0,
        Role::Operator => 1,
        Role::Observer => 2,
        Role::Executor => 3,
    }
}

fn get_role(r: &mut R) -> Result<Role, CodecError> {
    match r.u8()? {
        0 => Ok(Role::Agent),
        1 => Ok(Role::Operator),
        2 => Ok(Role::Observer),
        3 => Ok(Role::Executor),
        b => Err(r.err(format!("bad role {b}"))),
    }
}

fn put_role(w: &mut W, r: Role) {
    w.u8(role_byte(r));
}

// ---------------------------------------------------------------- records

/// Appends the encoding of `rec` to `out` (no allocation beyond `out` growing).
pub fn encode_record(rec: &Record, out: &mut Vec<u8>) {
    let mut w = W(out);
    w.u8(RECORD_VERSION);
    w.u64(rec.at);
    w.str(rec.principal.name.as_str());
    put_role(&mut w, rec.principal.role);
    w.strs(&rec.principal.groups);
    if rec.principal.part != Part::Main {
        w.u8(PART_TAG);
        w.u8(idx(Part::ALL, &rec.principal.part));
    }
    match &rec.command {
        Command::Admit(a) => {
            let spend = !a.reserve.is_zero()
                || a.limits.max_spend.is_some()
                || a.limits.max_tokens.is_some();
            if spend {
                w.u8(SPEND_ADMIT_TAG);
            }
            // Tag 17 is an admission whose policy says how to build its compensation's
            // arguments, 18 one whose tool declares a lookup (with either mapping or none);
            // without those it is written as before (tag 1). Tag 20 is tag 18 whose lookup's
            // arguments are built by a mapping (`lookup_args`).
            w.u8(match (&a.policy.compensate_args, &a.policy.lookup) {
                (_, Some(_)) if a.policy.lookup_args.is_some() => 20,
                (_, Some(_)) => 18,
                (Some(_), None) => 17,
                (None, None) => 1,
            });
            w.str(a.run.as_str());
            w.str(a.key.as_str());
            w.str(a.tool.as_str());
            w.digest(&a.digest);
            w.opt_str(a.args.as_deref());
            w.bool(a.start);
            w.opt_str(a.parent.as_ref().map(RunId::as_str));
            w.u32(a.labels.len() as u32);
            for (k, v) in &a.labels {
                w.str(k);
                w.str(v);
            }
            w.opt_u64(a.limits.deadline_at);
            w.opt_u64(a.limits.max_effects);
            let p = &a.policy;
            w.u8(idx(PolicyAction::ALL, &p.action));
            w.u8(idx(EffectClass::ALL, &p.class));
            w.u8(idx(Reversibility::ALL, &p.reversibility));
            w.opt_str(p.compensate.as_ref().map(ToolName::as_str));
            w.u32(p.quorum);
            w.strs(&p.groups);
            w.u64(p.expiry_ms);
            w.str(&p.rule);
            match &p.lookup {
                Some(lookup) => {
                    w.opt_str(p.compensate_args.as_deref());
                    w.str(lookup.as_str());
                    if let Some(m) = &p.lookup_args {
                        w.str(m);
                    }
                }
                None => {
                    if let Some(m) = &p.compensate_args {
                        w.str(m);
                    }
                }
            }
            if spend {
                w.opt_u64(a.limits.max_spend);
                w.opt_u64(a.limits.max_tokens);
                put_spend(&mut w, a.reserve);
            }
        }
        Command::Recheck { run, key } => {
            w.u8(2);
            w.str(run.as_str());
            w.str(key.as_str());
        }
        Command::Start { run, key, token } => {
            w.u8(3);
            w.str(run.as_str());
            w.str(key.as_str());
            w.u32(token.epoch);
            w.u64(token.serial);
        }
        Command::Complete {
            run,
            key,
            token,
            outcome,
            result,
            error,
            cost,
        } => {
            w.u8(if cost.is_zero() {
                4
            } else {
                SPEND_COMPLETE_TAG
            });
            w.str(run.as_str());
            w.str(key.as_str());
            w.u32(token.epoch);
            w.u64(token.serial);
            w.u8(idx(Outcome::ALL, outcome));
            w.opt_str(result.as_deref());
            w.opt_str(error.as_deref());
            if !cost.is_zero() {
                put_spend(&mut w, *cost);
            }
        }
        Command::Decide {
            run,
            key,
            decision,
            reason,
        } => {
            w.u8(5);
            w.str(run.as_str());
            w.str(key.as_str());
            w.u8(idx(Decision::ALL, decision));
            w.opt_str(reason.as_deref());
        }
        Command::Cancel { run, reason, kill } => {
            w.u8(6);
            w.str(run.as_str());
            w.opt_str(reason.as_deref());
            w.bool(*kill);
        }
        Command::Pause { run } => {
            w.u8(7);
            w.str(run.as_str());
        }
        Command::Resume { run } => {
            w.u8(8);
            w.str(run.as_str());
        }
        Command::Close { run, failed } => {
            w.u8(9);
            w.str(run.as_str());
            w.bool(*failed);
        }
        Command::Tick { run } => {
            w.u8(10);
            w.str(run.as_str());
        }
        Command::Compact {
            before,
            tombstones_before,
        } => {
            // Tag 11 (`before` alone) is the compaction of ledgers written before tombstones; 12
            // is the token record.
            w.u8(13);
            w.u64(*before);
            w.u64(*tombstones_before);
        }
        Command::Token(t) => {
            w.u8(12);
            w.u8(idx(TokenAction::ALL, &t.action));
            w.str(t.name.as_str());
            put_role(&mut w, t.role);
            w.strs(&t.groups);
        }
        Command::CompensationBegin {
            run,
            key,
            attempt,
            args,
        } => {
            w.u8(14);
            w.str(run.as_str());
            w.str(key.as_str());
            w.u32(*attempt);
            w.opt_str(args.as_deref());
        }
        Command::CompensationEnd {
            run,
            key,
            attempt,
            outcome,
            error,
        } => {
            w.u8(15);
            w.str(run.as_str());
            w.str(key.as_str());
            w.u32(*attempt);
            w.u8(idx(Outcome::ALL, outcome));
            w.opt_str(error.as_deref());
        }
        Command::Saga { run, key, action } => {
            w.u8(16);
            w.str(run.as_str());
            w.str(key.as_str());
            match action {
                // 0 is a settle without a result, as written before results could be given.
                SagaAction::Settle { outcome, result } => {
                    w.u8(if result.is_some() { 3 } else { 0 });
                    w.u8(idx(Outcome::ALL, outcome));
                    if let Some(r) = result {
                        w.str(r);
                    }
                }
                SagaAction::Retry => w.u8(1),
                SagaAction::Skip { reason } => {
                    w.u8(2);
                    w.str(reason);
                }
                SagaAction::Compensate => w.u8(4),
            }
        }
        Command::SagaStep { run, key, step } => {
            w.u8(19);
            w.str(run.as_str());
            w.str(key.as_str());
            match step {
                SagaStep::LookupBegin { attempt } => {
                    w.u8(0);
                    w.u32(*attempt);
                }
                SagaStep::LookupEnd {
                    attempt,
                    outcome,
                    result,
                    error,
                } => {
                    w.u8(1);
                    w.u32(*attempt);
                    w.u8(idx(Outcome::ALL, outcome));
                    w.opt_str(result.as_deref());
                    w.opt_str(error.as_deref());
                }
                SagaStep::Blocked { attempt, reason } => {
                    w.u8(2);
                    w.u32(*attempt);
                    w.str(reason);
                }
                SagaStep::Unreported { after_ms } => {
                    w.u8(3);
                    w.u64(*after_ms);
                }
                SagaStep::Held {
                    attempt,
                    quorum,
                    groups,
                    expiry_ms,
                    args,
                    reason,
                } => {
                    w.u8(4);
                    w.u32(*attempt);
                    w.u32(*quorum);
                    w.strs(groups);
                    w.u64(*expiry_ms);
                    w.opt_str(args.as_deref());
                    w.str(reason);
                }
                SagaStep::Expired { approval } => {
                    w.u8(5);
                    w.u64(*approval);
                }
            }
        }
    }
}

/// Decodes one record. For the records of a whole ledger, `RecordDecoder` gives the same
/// results with fewer allocations.
pub fn decode_record(buf: &[u8]) -> Result<Record, CodecError> {
    RecordDecoder::default().decode(buf)
}

/// Decodes a ledger's records in order (recovery). What usually repeats from one record to the
/// next (the principal, the run, the tool, the rule) is compared with the previous record's as
/// bytes and, when equal, shared (`Arc`) instead of allocated and checked again: replay is
/// bounded by allocation. A real ledger interleaves runs, so the run is shared less often there
/// than in one run's burst. The results are exactly `decode_record`'s.
#[derive(Debug, Default)]
pub struct RecordDecoder {
    principal: Option<Principal>,
    run: Option<RunId>,
    tool: Option<ToolName>,
    rule: Option<std::sync::Arc<str>>,
}

impl RecordDecoder {
    pub fn decode(&mut self, buf: &[u8]) -> Result<Record, CodecError> {
        let mut r = R {
            buf,
            pos: 0,
            what: "record",
        };
        let v = r.u8()?;
        if v != RECORD_VERSION {
            return Err(r.err(format!("unsupported record version {v}")));
        }
        let at = r.u64()?;
        let mut principal = self.principal(&mut r)?;
        let mut outer = r.u8()?;
        if outer == PART_TAG {
            principal.part = r.enum_of(Part::ALL)?;
            outer = r.u8()?;
        }
        let command = match outer {
            SPEND_ADMIT_TAG | 1 | 17 | 18 | 20 => {
                let tag = if outer == SPEND_ADMIT_TAG {
                    match r.u8()? {
                        t @ (1 | 17 | 18 | 20) => t,
                        t => return Err(r.err(format!("unknown admission tag {t}"))),
                    }
                } else {
                    outer
                };
                let run = self.run(&mut r)?;
                let key = r.key()?;
                let tool = self.tool(&mut r)?;
                let digest = r.digest()?;
                let args = r.opt(R::boxed)?;
                let start = r.bool()?;
                let parent = r.opt(R::run)?;
                let n = r.count(8)?;
                let mut labels = Vec::with_capacity(n);
                for _ in 0..n {
                    labels.push((r.boxed()?, r.boxed()?));
                }
                let mut limits = RunLimits {
                    deadline_at: r.opt(R::u64)?,
                    max_effects: r.opt(R::u64)?,
                    max_spend: None,
                    max_tokens: None,
                };
                let policy = PolicyDecision {
                    action: r.enum_of(PolicyAction::ALL)?,
                    class: r.enum_of(EffectClass::ALL)?,
                    reversibility: r.enum_of(Reversibility::ALL)?,
                    compensate: r.opt(R::tool)?,
                    compensate_args: None,
                    lookup: None,
                    lookup_args: None,
                    quorum: r.u32()?,
                    groups: r.strs()?,
                    expiry_ms: r.u64()?,
                    rule: self.rule(&mut r)?,
                };
                let (compensate_args, lookup, lookup_args) = match tag {
                    17 => (Some(r.str()?.into()), None, None),
                    18 => (r.opt(R::str)?.map(Into::into), Some(r.tool()?), None),
                    20 => (
                        r.opt(R::str)?.map(Into::into),
                        Some(r.tool()?),
                        Some(r.str()?.into()),
                    ),
                    _ => (None, None, None),
                };
                let policy = Box::new(PolicyDecision {
                    compensate_args,
                    lookup,
                    lookup_args,
                    ..policy
                });
                let mut reserve = Spend::default();
                if outer == SPEND_ADMIT_TAG {
                    limits.max_spend = r.opt(R::u64)?;
                    limits.max_tokens = r.opt(R::u64)?;
                    reserve = get_spend(&mut r)?;
                }
                Command::Admit(Admit {
                    run,
                    key,
                    tool,
                    digest,
                    args,
                    start,
                    parent,
                    labels,
                    limits,
                    policy,
                    reserve,
                })
            }
            2 => Command::Recheck {
                run: self.run(&mut r)?,
                key: r.key()?,
            },
            3 => Command::Start {
                run: self.run(&mut r)?,
                key: r.key()?,
                token: Token {
                    epoch: r.u32()?,
                    serial: r.u64()?,
                },
            },
            tag @ (4 | SPEND_COMPLETE_TAG) => Command::Complete {
                run: self.run(&mut r)?,
                key: r.key()?,
                token: Token {
                    epoch: r.u32()?,
                    serial: r.u64()?,
                },
                outcome: r.enum_of(Outcome::ALL)?,
                result: r.opt(R::boxed)?,
                error: r.opt(R::boxed)?,
                cost: if tag == SPEND_COMPLETE_TAG {
                    get_spend(&mut r)?
                } else {
                    Spend::default()
                },
            },
            5 => Command::Decide {
                run: self.run(&mut r)?,
                key: r.key()?,
                decision: r.enum_of(Decision::ALL)?,
                reason: r.opt(R::boxed)?,
            },
            6 => Command::Cancel {
                run: self.run(&mut r)?,
                reason: r.opt(R::boxed)?,
                kill: r.bool()?,
            },
            7 => Command::Pause {
                run: self.run(&mut r)?,
            },
            8 => Command::Resume {
                run: self.run(&mut r)?,
            },
            9 => Command::Close {
                run: self.run(&mut r)?,
                failed: r.bool()?,
            },
            10 => Command::Tick {
                run: self.run(&mut r)?,
            },
            // Written before runs were forgotten: it dropped per-effect state and kept every
            // run. Replayed now it forgets them, and no tombstone ever expires by it.
            11 => Command::Compact {
                before: r.u64()?,
                tombstones_before: 0,
            },
            12 => Command::Token(TokenChange {
                action: r.enum_of(TokenAction::ALL)?,
                name: r.principal_name()?,
                role: get_role(&mut r)?,
                groups: r.strs()?,
            }),
            13 => Command::Compact {
                before: r.u64()?,
                tombstones_before: r.u64()?,
            },
            14 => Command::CompensationBegin {
                run: self.run(&mut r)?,
                key: r.key()?,
                attempt: r.u32()?,
                args: r.opt(R::boxed)?,
            },
            15 => Command::CompensationEnd {
                run: self.run(&mut r)?,
                key: r.key()?,
                attempt: r.u32()?,
                outcome: r.enum_of(Outcome::ALL)?,
                error: r.opt(R::boxed)?,
            },
            16 => Command::Saga {
                run: self.run(&mut r)?,
                key: r.key()?,
                action: match r.u8()? {
                    t @ (0 | 3) => SagaAction::Settle {
                        outcome: r.enum_of(Outcome::ALL)?,
                        result: if t == 3 { Some(r.boxed()?) } else { None },
                    },
                    1 => SagaAction::Retry,
                    2 => SagaAction::Skip { reason: r.boxed()? },
                    4 => SagaAction::Compensate,
                    t => return Err(r.err(format!("unknown saga action {t}"))),
                },
            },
            19 => Command::SagaStep {
                run: self.run(&mut r)?,
                key: r.key()?,
                step: match r.u8()? {
                    0 => SagaStep::LookupBegin { attempt: r.u32()? },
                    1 => SagaStep::LookupEnd {
                        attempt: r.u32()?,
                        outcome: r.enum_of(Outcome::ALL)?,
                        result: r.opt(R::boxed)?,
                        error: r.opt(R::boxed)?,
                    },
                    2 => SagaStep::Blocked {
                        attempt: r.u32()?,
                        reason: r.boxed()?,
                    },
                    3 => SagaStep::Unreported { after_ms: r.u64()? },
                    4 => SagaStep::Held {
                        attempt: r.u32()?,
                        quorum: r.u32()?,
                        groups: r.strs()?,
                        expiry_ms: r.u64()?,
                        args: r.opt(R::boxed)?,
                        reason: r.boxed()?,
                    },
                    5 => SagaStep::Expired { approval: r.u64()? },
                    t => return Err(r.err(format!("unknown saga step {t}"))),
                },
            },
            t => return Err(r.err(format!("unknown command tag {t}"))),
        };
        r.done()?;
        Ok(Record {
            at,
            principal,
            command,
        })
    }

    fn principal(&mut self, r: &mut R) -> Result<Principal, CodecError> {
        let start = r.pos;
        if let Some(p) = &self.principal
            && r.next_str_is(p.name.as_str())
            && r.u8().is_ok_and(|b| b == role_byte(p.role))
            && r.u32().is_ok_and(|n| n as usize == p.groups.len())
            && p.groups.iter().all(|g| r.next_str_is(g))
        {
            return Ok(p.clone());
        }
        r.pos = start;
        let name = r.principal_name()?;
        let role = get_role(r)?;
        let groups = r.strs()?;
        let p = Principal {
            name,
            role,
            groups,
            part: Part::Main,
        };
        self.principal = Some(p.clone());
        Ok(p)
    }

    fn run(&mut self, r: &mut R) -> Result<RunId, CodecError> {
        if let Some(run) = &self.run
            && r.next_str_is(run.as_str())
        {
            return Ok(run.clone());
        }
        let run = r.run()?;
        self.run = Some(run.clone());
        Ok(run)
    }

    fn tool(&mut self, r: &mut R) -> Result<ToolName, CodecError> {
        if let Some(tool) = &self.tool
            && r.next_str_is(tool.as_str())
        {
            return Ok(tool.clone());
        }
        let tool = r.tool()?;
        self.tool = Some(tool.clone());
        Ok(tool)
    }

    fn rule(&mut self, r: &mut R) -> Result<std::sync::Arc<str>, CodecError> {
        if let Some(rule) = &self.rule
            && r.next_str_is(rule)
        {
            return Ok(rule.clone());
        }
        let rule: std::sync::Arc<str> = r.str()?.into();
        self.rule = Some(rule.clone());
        Ok(rule)
    }
}

// ---------------------------------------------------------------- snapshots

fn put_status(w: &mut W, s: Status) {
    w.u8(idx(EffectStatus::ALL, &s.kind()));
    w.u8(match s {
        Status::Held(h) => idx(HoldReason::ALL, &h),
        Status::Refused(r) => idx(RefusalReason::ALL, &r),
        _ => 0,
    });
}

fn get_status(r: &mut R) -> Result<Status, CodecError> {
    let kind = r.enum_of(EffectStatus::ALL)?;
    let sub = r.u8()?;
    let sub_of = |all_len: usize, r: &R| {
        if (sub as usize) < all_len {
            Ok(sub as usize)
        } else {
            Err(r.err(format!("bad status detail {sub}")))
        }
    };
    Ok(match kind {
        EffectStatus::Held => Status::Held(HoldReason::ALL[sub_of(HoldReason::ALL.len(), r)?]),
        EffectStatus::Refused => {
            Status::Refused(RefusalReason::ALL[sub_of(RefusalReason::ALL.len(), r)?])
        }
        EffectStatus::Approved => Status::Approved,
        EffectStatus::Admitted => Status::Admitted,
        EffectStatus::Started => Status::Started,
        EffectStatus::Completed => Status::Completed,
        EffectStatus::Failed => Status::Failed,
        EffectStatus::Unknown => Status::Unknown,
        EffectStatus::Compensating => Status::Compensating,
        EffectStatus::Compensated => Status::Compensated,
        EffectStatus::CompensationFailed => Status::CompensationFailed,
        EffectStatus::NeedsHuman => Status::NeedsHuman,
        EffectStatus::CompensationSkipped => Status::CompensationSkipped,
    })
}

fn put_effect(w: &mut W, e: &Effect) {
    w.str(e.tool.as_str());
    w.digest(&e.digest);
    w.u8(idx(EffectClass::ALL, &e.class));
    w.u8(idx(Reversibility::ALL, &e.reversibility));
    w.opt_str(e.compensate.as_ref().map(ToolName::as_str));
    w.str(&e.rule);
    w.u8(idx(PolicyAction::ALL, &e.action));
    put_approval(w, e.approval.as_deref());
    w.opt_str(e.args.as_deref());
    w.bool(e.start_on_admit);
    put_status(w, e.status);
    match e.token {
        None => w.u8(0),
        Some(t) => {
            w.u8(1);
            w.u32(t.epoch);
            w.u64(t.serial);
        }
    }
    w.u64(e.created_at);
    w.u64(e.updated_at);
    w.bool(e.late);
    match &e.outcome {
        None => w.u8(0),
        Some(o) => {
            w.u8(1);
            match o.outcome {
                None => w.u8(0),
                Some(x) => {
                    w.u8(1);
                    w.u8(idx(Outcome::ALL, &x));
                }
            }
            w.opt_str(o.result.as_deref());
            w.opt_str(o.error.as_deref());
        }
    }
    w.opt_str(e.compensate_args.as_deref());
    w.opt_str(e.lookup.as_ref().map(ToolName::as_str));
    w.opt_str(e.lookup_args.as_deref());
    match &e.saga {
        None => w.u8(0),
        Some(c) => {
            w.u8(1);
            w.u32(c.attempts);
            w.u32(c.granted);
            w.u64(c.retry_at);
            w.opt_str(c.args.as_deref());
            w.opt_str(c.note.as_deref());
            w.opt_str(c.by.as_ref().map(PrincipalName::as_str));
            w.u32(c.lookups);
            w.u32(c.lookups_granted);
            w.bool(c.lookup_open);
            w.bool(c.chosen);
            put_approval(w, c.approval.as_deref());
        }
    }
    match &e.spend {
        None => w.u8(0),
        Some(s) => {
            w.u8(1);
            put_spend(w, s.reserve);
            w.bool(s.counted);
            match s.cost {
                None => w.u8(0),
                Some(c) => {
                    w.u8(1);
                    put_spend(w, c);
                }
            }
        }
    }
    w.u8(idx(Part::ALL, &e.holder));
    w.u32(e.disputes);
}

fn put_spend(w: &mut W, s: Spend) {
    w.u64(s.usd_micros);
    w.u64(s.tokens);
}

fn get_spend(r: &mut R) -> Result<Spend, CodecError> {
    Ok(Spend {
        usd_micros: r.u64()?,
        tokens: r.u64()?,
    })
}

/// An approval, of an admission or of a compensating call: absent, or its id, bounds, votes
/// and rejection.
fn put_approval(w: &mut W, a: Option<&Approval>) {
    let Some(a) = a else {
        w.u8(0);
        return;
    };
    w.u8(1);
    w.u64(a.id);
    w.u32(a.quorum);
    w.strs(&a.groups);
    w.u64(a.expiry_ms);
    w.u64(a.requested_at);
    w.u64(a.expires_at);
    w.u32(a.approvers.len() as u32);
    for ap in &a.approvers {
        w.str(ap.name.as_str());
        w.strs(&ap.groups);
        w.u64(ap.at);
    }
    w.opt_str(a.rejected_by.as_ref().map(PrincipalName::as_str));
    w.opt_str(a.reason.as_deref());
}

fn get_approval(r: &mut R) -> Result<Box<Approval>, CodecError> {
    let id = r.u64()?;
    let quorum = r.u32()?;
    let groups = r.strs()?;
    let expiry_ms = r.u64()?;
    let requested_at = r.u64()?;
    let expires_at = r.u64()?;
    let n = r.count(16)?;
    let mut approvers = Vec::with_capacity(n);
    for _ in 0..n {
        approvers.push(Approver {
            name: r.principal_name()?,
            groups: r.strs()?,
            at: r.u64()?,
        });
    }
    let rejected_by = r.opt(R::principal_name)?;
    let reason = r.opt(R::boxed)?;
    Ok(Box::new(Approval {
        id,
        quorum,
        groups,
        expiry_ms,
        requested_at,
        expires_at,
        approvers,
        rejected_by,
        reason,
    }))
}

/// One effect; before `version` 3 it has no compensation.
fn get_effect(r: &mut R, interned: &mut Interner, version: u8) -> Result<Effect, CodecError> {
    let tool = interned.tool(&r.tool()?);
    let digest = r.digest()?;
    let class = r.enum_of(EffectClass::ALL)?;
    let reversibility = r.enum_of(Reversibility::ALL)?;
    let compensate = r.opt(R::tool)?;
    let rule = interned.rule(r.str()?);
    let action = r.enum_of(PolicyAction::ALL)?;
    let approval = r.opt(get_approval)?;
    let args = r.opt(R::boxed)?.map(std::sync::Arc::from);
    let start_on_admit = r.bool()?;
    let status = get_status(r)?;
    let token = r.opt(|r| {
        Ok(Token {
            epoch: r.u32()?,
            serial: r.u64()?,
        })
    })?;
    let created_at = r.u64()?;
    let updated_at = r.u64()?;
    let late = r.bool()?;
    let outcome = r.opt(|r| {
        Ok(Box::new(OutcomeRecord {
            outcome: r.opt(|r| r.enum_of(Outcome::ALL))?,
            result: r.opt(R::boxed)?,
            error: r.opt(R::boxed)?,
        }))
    })?;
    let (compensate_args, (lookup, lookup_args), saga) = if version < 3 {
        (None, (None, None), None)
    } else {
        let args = r.opt(R::str)?.map(std::sync::Arc::from);
        let lookup = if version >= 4 { r.opt(R::tool)? } else { None };
        let lookup_args = if version >= 7 {
            r.opt(R::str)?.map(std::sync::Arc::from)
        } else {
            None
        };
        let saga = r.opt(|r| {
            let mut c = Compensation {
                attempts: r.u32()?,
                granted: r.u32()?,
                retry_at: r.u64()?,
                args: r.opt(R::boxed)?,
                note: r.opt(R::boxed)?,
                by: r.opt(R::principal_name)?,
                lookups: 0,
                lookups_granted: 1,
                lookup_open: false,
                chosen: false,
                approval: None,
            };
            if version >= 4 {
                c.lookups = r.u32()?;
                c.lookups_granted = r.u32()?;
                c.lookup_open = r.bool()?;
                c.chosen = r.bool()?;
            }
            if version >= 5 {
                c.approval = r.opt(get_approval)?;
            }
            Ok(Box::new(c))
        })?;
        (args, (lookup, lookup_args), saga)
    };
    let spend = if version >= 6 {
        r.opt(|r| {
            Ok(Box::new(EffectSpend {
                reserve: get_spend(r)?,
                counted: r.bool()?,
                cost: r.opt(get_spend)?,
            }))
        })?
    } else {
        None
    };
    let (holder, disputes) = if version >= 8 {
        (r.enum_of(Part::ALL)?, r.u32()?)
    } else {
        (Part::Main, 0)
    };
    Ok(Effect {
        tool,
        digest,
        class,
        reversibility,
        compensate,
        compensate_args,
        lookup,
        lookup_args,
        rule,
        action,
        approval,
        args,
        start_on_admit,
        holder,
        disputes,
        status,
        token,
        created_at,
        updated_at,
        late,
        outcome,
        saga,
        spend,
    })
}

/// Encodes the whole gate state (limits are configuration and are not included).
pub fn encode_snapshot(gate: &Gate, out: &mut Vec<u8>) {
    let mut w = W(out);
    w.u8(SNAPSHOT_VERSION);
    w.u64(gate.runs.len() as u64);
    for (id, run) in gate.runs.iter() {
        w.str(id.as_str());
        w.opt_str(run.parent.as_ref().map(RunId::as_str));
        w.u32(run.children.len() as u32);
        for c in &run.children {
            w.str(c.as_str());
        }
        w.opt_str(run.owner.as_ref().map(PrincipalName::as_str));
        w.u32(run.labels.len() as u32);
        for (k, v) in &run.labels {
            w.str(k);
            w.str(v);
        }
        w.u64(run.created_at);
        w.u8(idx(RunState::ALL, &run.state));
        match &run.stop {
            None => w.u8(0),
            Some(s) => {
                w.u8(1);
                w.u8(idx(StopCause::ALL, &s.cause));
                w.opt_str(s.reason.as_deref());
                w.opt_str(s.by.as_ref().map(PrincipalName::as_str));
                w.u64(s.at);
                w.opt_str(s.from.as_ref().map(RunId::as_str));
            }
        }
        w.u32(run.epoch);
        w.opt_u64(run.limits.deadline_at);
        w.opt_u64(run.limits.max_effects);
        w.u64(run.admitted);
        w.u32(run.pending_approvals);
        w.u32(run.in_flight);
        w.u64(run.next_serial);
        w.u64(run.next_approval);
        w.u32(run.rejected.len() as u32);
        for d in &run.rejected {
            w.digest(d);
        }
        w.u32(run.effects.len() as u32);
        for (k, e) in &run.effects {
            w.str(k.as_str());
            put_effect(&mut w, e);
        }
        w.opt_u64(run.limits.max_spend);
        w.opt_u64(run.limits.max_tokens);
        put_spend(&mut w, run.spent);
        put_spend(&mut w, run.reserved);
    }
    w.u64(gate.tombstones.len() as u64);
    for (id, t) in gate.tombstones.iter() {
        w.str(id.as_str());
        w.opt_str(t.owner.as_ref().map(PrincipalName::as_str));
        w.u8(idx(StopCause::ALL, &t.cause));
        w.u32(t.epoch);
        w.u64(t.created_at);
        w.u64(t.stopped_at);
    }
}

pub fn decode_snapshot(buf: &[u8], limits: Limits) -> Result<Gate, CodecError> {
    let mut interned = Interner::default();
    let mut r = R {
        buf,
        pos: 0,
        what: "snapshot",
    };
    let version = r.u8()?;
    if !(1..=SNAPSHOT_VERSION).contains(&version) {
        return Err(r.err(format!("unsupported snapshot version {version}")));
    }
    let n = r.u64()?;
    let mut owners = Owners::default();
    // Collected in one go: the ids come in order, and the ordered index is then built in bulk.
    let runs = (0..n)
        .map(|_| get_run(&mut r, &mut interned, &mut owners, version))
        .collect::<Result<Runs, _>>()?;
    let tombstones = if version == 1 {
        Tombstones::default()
    } else {
        let n = r.u64()?;
        // Each takes at least 27 bytes: a hostile count cannot make us allocate.
        if n.saturating_mul(27) > (buf.len() - r.pos) as u64 {
            return Err(r.err(format!("tombstone count {n} exceeds the remaining bytes")));
        }
        let items = (0..n)
            .map(|_| get_tombstone(&mut r, &mut owners))
            .collect::<Result<Vec<_>, _>>()?;
        Tombstones::try_from_iter(items.into_iter())
            .map_err(|id| r.err(format!("run {id} has two tombstones")))?
    };
    r.done()?;
    if let Some((id, _)) = tombstones.iter().find(|(id, _)| runs.contains_key(id)) {
        return Err(r.err(format!("run {id} is both a run and a tombstone")));
    }
    Ok(Gate::from_parts(runs, tombstones, limits, interned))
}

fn get_tombstone(r: &mut R, owners: &mut Owners) -> Result<(RunId, Tombstone), CodecError> {
    Ok((
        r.run()?,
        Tombstone {
            owner: r.opt(|r| owners.get(r))?,
            cause: r.enum_of(StopCause::ALL)?,
            epoch: r.u32()?,
            created_at: r.u64()?,
            stopped_at: r.u64()?,
        },
    ))
}

/// One run; `version` 1 has a `compacted` byte (a run whose effects retention dropped: it is
/// now an ordinary stopped run without effects, forgotten by the next compaction).
/// One shared copy of each owner's name while a snapshot is decoded (the gate shares them too:
/// every run of a principal names it through one `Arc`). Few principals own runs; past
/// `OWNERS_SHARED_MAX` names are simply not shared.
#[derive(Default)]
struct Owners(Vec<PrincipalName>);

const OWNERS_SHARED_MAX: usize = 64;

impl Owners {
    fn get(&mut self, r: &mut R) -> Result<PrincipalName, CodecError> {
        let name = r.str()?;
        if let Some(p) = self.0.iter().find(|p| p.as_str() == name) {
            return Ok(p.clone());
        }
        let p = PrincipalName::new(name).map_err(|e| r.err(e.to_string()))?;
        if self.0.len() < OWNERS_SHARED_MAX {
            self.0.push(p.clone());
        }
        Ok(p)
    }
}

fn get_run(
    r: &mut R,
    interned: &mut Interner,
    owners: &mut Owners,
    version: u8,
) -> Result<(RunId, Run), CodecError> {
    let id = r.run()?;
    let parent = r.opt(R::run)?;
    let nc = r.count(4)?;
    let children = (0..nc).map(|_| r.run()).collect::<Result<Vec<_>, _>>()?;
    let owner = r.opt(|r| owners.get(r))?;
    let nl = r.count(8)?;
    let mut labels = Vec::with_capacity(nl);
    for _ in 0..nl {
        labels.push((r.boxed()?, r.boxed()?));
    }
    let created_at = r.u64()?;
    let state = r.enum_of(RunState::ALL)?;
    let stop = r.opt(|r| {
        Ok(Stop {
            cause: r.enum_of(StopCause::ALL)?,
            reason: r.opt(R::boxed)?,
            by: r.opt(R::principal_name)?,
            at: r.u64()?,
            from: r.opt(R::run)?,
        })
    })?;
    // Stopped exactly when finalizing or terminal (a stop sets both at once): a run that says
    // otherwise could make a later stop or settle illegal (`kernel::transitions`).
    let stopped = state == RunState::Finalizing || state.is_terminal();
    if stopped != stop.is_some() {
        let has = if stop.is_some() { "a stop" } else { "no stop" };
        return Err(r.err(format!("run {id} is {state} with {has}")));
    }
    let epoch = r.u32()?;
    let mut limits = RunLimits {
        deadline_at: r.opt(R::u64)?,
        max_effects: r.opt(R::u64)?,
        max_spend: None,
        max_tokens: None,
    };
    let admitted = r.u64()?;
    let pending_approvals = r.u32()?;
    let in_flight = r.u32()?;
    let next_serial = r.u64()?;
    let next_approval = r.u64()?;
    if version == 1 {
        r.bool()?;
    }
    let nr = r.count(32)?;
    let mut rejected = BTreeSet::new();
    for _ in 0..nr {
        rejected.insert(r.digest()?);
    }
    let ne = r.count(40)?;
    let mut effects = BTreeMap::new();
    for _ in 0..ne {
        let k = r.key()?;
        effects.insert(k, get_effect(r, interned, version)?);
    }
    let (mut spent, mut reserved) = (Spend::default(), Spend::default());
    if version >= 6 {
        limits.max_spend = r.opt(R::u64)?;
        limits.max_tokens = r.opt(R::u64)?;
        spent = get_spend(r)?;
        reserved = get_spend(r)?;
    }
    let mut run = Run {
        parent,
        children,
        owner,
        labels,
        created_at,
        state,
        stop,
        epoch,
        limits,
        admitted,
        spent,
        reserved,
        pending_approvals,
        in_flight,
        effects,
        rejected,
        next_serial,
        next_approval,
        held: 0,
        expiries: BTreeSet::new(),
    };
    run.index();
    Ok((id, run))
}
