//! A bounded reader of Python pickles (protocols 0–5), enough to walk the
//! plain data of a PyTorch memory snapshot.
//!
//! Why not `serde_pickle::from_slice` into `serde_pickle::Value`: that crate
//! copies a memoized value for every reference to it (`BINGET`) and converts
//! values recursively, so a few hundred bytes of hostile input (a list that
//! holds two references to a list that holds two references to …) expand to
//! an exponential amount of memory, and deep nesting overflows the stack. A
//! snapshot can come from anywhere, so this reader keeps Python's own
//! semantics instead: the memo holds *references*, values live once in an
//! arena ([`store`]) and are shared, nothing is recursive.
//!
//! Bounds (both hold for any input):
//! - memory: every structure is charged to a [`Budget`] before it grows
//!   (the import sets its limit from the input size), and a growth past the
//!   limit is an error naming the limit and the opcode's offset; every
//!   opcode adds at most one value, counted against `max_values`;
//! - time is linear in the input: no opcode does work proportional to
//!   anything but its own argument, except those that move items popped
//!   off the stack, and each item is moved at most once (plus the amortized
//!   moves of a growing container).
//!
//! What the import never reads is not kept ([`roles`]): a container built
//! where the snapshot's schema has nothing the import uses is replaced by a
//! shared [`Node::Skipped`] of its kind (filling it fails as filling the
//! real one would, and its items are dropped), and a `frames` list keeps
//! its first item only. [`parse`] with `keep_all` keeps everything.
//!
//! Classes and functions (`GLOBAL`, `REDUCE`, `NEWOBJ`, …) are never called:
//! they become opaque [`Node::Object`]s that keep the items and state the
//! pickle gives them, so that a dict subclass still reads as a dict.

mod memo;
mod roles;
mod store;

use std::cell::Cell;
use std::fmt;

use self::memo::Memo;
use self::roles::{Role, Shape, Slot};
use self::store::{Kind, Node, NodeId, Object, Span, Store, Text, NO_NODE};
pub(crate) use self::store::{Pickle, Val};
use super::budget::{Budget, Exceeded};

/// Why a pickle was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PickleError {
    /// Malformed input at a byte offset.
    At { offset: usize, message: String },
    /// The input holds more values than the configured limit.
    TooManyValues(usize),
    /// Reading it would hold more than `limit` accounted bytes (at the
    /// opcode at `offset`).
    MemoryLimit { limit: u64, offset: usize },
}

impl fmt::Display for PickleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PickleError::At { offset, message } => {
                write!(f, "malformed pickle at byte {offset}: {message}")
            }
            PickleError::TooManyValues(limit) => {
                write!(f, "the pickle holds more than {limit} values (raise ImportLimits::max_values)")
            }
            PickleError::MemoryLimit { limit, offset } => {
                write!(f, "reading the pickle needs more than {limit} bytes (at byte {offset})")
            }
        }
    }
}

// Opcodes (Python's `pickle.py` names).
const MARK: u8 = b'(';
const STOP: u8 = b'.';
const POP: u8 = b'0';
const POP_MARK: u8 = b'1';
const DUP: u8 = b'2';
const FLOAT: u8 = b'F';
const INT: u8 = b'I';
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const LONG: u8 = b'L';
const BININT2: u8 = b'M';
const NONE: u8 = b'N';
const PERSID: u8 = b'P';
const BINPERSID: u8 = b'Q';
const REDUCE: u8 = b'R';
const STRING: u8 = b'S';
const BINSTRING: u8 = b'T';
const SHORT_BINSTRING: u8 = b'U';
const UNICODE: u8 = b'V';
const BINUNICODE: u8 = b'X';
const APPEND: u8 = b'a';
const BUILD: u8 = b'b';
const GLOBAL: u8 = b'c';
const DICT: u8 = b'd';
const EMPTY_DICT: u8 = b'}';
const APPENDS: u8 = b'e';
const GET: u8 = b'g';
const BINGET: u8 = b'h';
const INST: u8 = b'i';
const LONG_BINGET: u8 = b'j';
const LIST: u8 = b'l';
const EMPTY_LIST: u8 = b']';
const OBJ: u8 = b'o';
const PUT: u8 = b'p';
const BINPUT: u8 = b'q';
const LONG_BINPUT: u8 = b'r';
const SETITEM: u8 = b's';
const TUPLE: u8 = b't';
const EMPTY_TUPLE: u8 = b')';
const SETITEMS: u8 = b'u';
const BINFLOAT: u8 = b'G';
const PROTO: u8 = 0x80;
const NEWOBJ: u8 = 0x81;
const EXT1: u8 = 0x82;
const EXT2: u8 = 0x83;
const EXT4: u8 = 0x84;
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const LONG1: u8 = 0x8a;
const LONG4: u8 = 0x8b;
const BINBYTES: u8 = b'B';
const SHORT_BINBYTES: u8 = b'C';
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE8: u8 = 0x8d;
const BINBYTES8: u8 = 0x8e;
const EMPTY_SET: u8 = 0x8f;
const ADDITEMS: u8 = 0x90;
const FROZENSET: u8 = 0x91;
const NEWOBJ_EX: u8 = 0x92;
const STACK_GLOBAL: u8 = 0x93;
const MEMOIZE: u8 = 0x94;
const FRAME: u8 = 0x95;
const BYTEARRAY8: u8 = 0x96;
const NEXT_BUFFER: u8 = 0x97;
const READONLY_BUFFER: u8 = 0x98;

/// Parses `input` (trailing bytes after `STOP` are ignored, as Python does),
/// charging `budget` for everything it keeps. Without `keep_all`, what the
/// snapshot import never reads is not kept (see the module documentation).
pub(crate) fn parse<'a>(
    input: &'a [u8],
    max_values: usize,
    budget: &mut Budget,
    keep_all: bool,
) -> Result<Pickle<'a>, PickleError> {
    if u32::try_from(input.len()).is_err() {
        return Err(PickleError::At { offset: 0, message: "input larger than 4 GiB".into() });
    }
    let mut p = Parser {
        input,
        pos: 0,
        op_pos: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Memo::default(),
        store: Store::default(),
        values: 0,
        max_values,
        budget,
        keep_all,
    };
    // The shared stand-ins of skipped containers: nodes 0 to 4.
    for kind in Kind::ALL {
        p.grow_nodes()?;
        p.store.nodes.push(Node::Skipped(kind));
        p.store.roles.push(Role::Unused);
    }
    let root = p.run()?;
    Ok(Pickle { input, store: p.store, root, touched: Cell::new(false) })
}

struct Parser<'a, 'b> {
    input: &'a [u8],
    pos: usize,
    /// Offset of the opcode being executed (for errors).
    op_pos: usize,
    stack: Vec<Val>,
    /// Stack lengths at each `MARK` still open.
    marks: Vec<usize>,
    memo: Memo,
    store: Store,
    /// Value slots created so far (stack pushes, nodes, marks, memo entries).
    values: usize,
    max_values: usize,
    budget: &'b mut Budget,
    keep_all: bool,
}

type R<T> = Result<T, PickleError>;

impl<'a> Parser<'a, '_> {
    fn fail<T>(&self, message: impl Into<String>) -> R<T> {
        Err(PickleError::At { offset: self.op_pos, message: message.into() })
    }

    fn over(&self, _: Exceeded) -> PickleError {
        PickleError::MemoryLimit { limit: self.budget.limit(), offset: self.op_pos }
    }

    fn spend(&mut self) -> R<()> {
        self.values += 1;
        if self.values > self.max_values {
            return Err(PickleError::TooManyValues(self.max_values));
        }
        Ok(())
    }

    fn bytes(&mut self, n: usize) -> R<&'a [u8]> {
        let input: &'a [u8] = self.input;
        match self.pos.checked_add(n).filter(|&end| end <= input.len()) {
            Some(end) => {
                let s = &input[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => self.fail("truncated input"),
        }
    }

    fn array<const N: usize>(&mut self) -> R<[u8; N]> {
        let b = self.bytes(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(b);
        Ok(a)
    }

    fn u8(&mut self) -> R<u8> {
        Ok(self.array::<1>()?[0])
    }

    fn u32_len(&mut self) -> R<usize> {
        Ok(u32::from_le_bytes(self.array()?) as usize)
    }

    fn i32_len(&mut self) -> R<usize> {
        let n = i32::from_le_bytes(self.array()?);
        if n < 0 {
            return self.fail("negative length");
        }
        Ok(n as usize)
    }

    fn u64_len(&mut self) -> R<usize> {
        let n = u64::from_le_bytes(self.array()?);
        match usize::try_from(n) {
            Ok(n) => Ok(n),
            Err(_) => self.fail("truncated input"),
        }
    }

    /// The bytes up to the next `\n` (consumed, not included).
    fn line(&mut self) -> R<&'a [u8]> {
        let input: &'a [u8] = self.input;
        let rest = &input[self.pos..];
        match memchr::memchr(b'\n', rest) {
            Some(i) => {
                self.pos += i + 1;
                Ok(&rest[..i])
            }
            None => self.fail("truncated input (no end of line)"),
        }
    }

    // -- values -------------------------------------------------------------

    fn push(&mut self, v: Val) -> R<()> {
        self.spend()?;
        self.budget.room(&mut self.stack, 1).map_err(|e| self.over(e))?;
        self.stack.push(v);
        Ok(())
    }

    fn int(&mut self, i: i64) -> R<Val> {
        if let Some(v) = Val::inline_int(i) {
            return Ok(v);
        }
        let Ok(idx) = u32::try_from(self.store.wide.len()) else {
            return Err(PickleError::TooManyValues(self.max_values));
        };
        self.budget.room(&mut self.store.wide, 1).map_err(|e| self.over(e))?;
        self.store.wide.push(i);
        Ok(Val::wide_int(idx))
    }

    fn push_int(&mut self, lit: IntLit) -> R<()> {
        let v = match lit {
            IntLit::Fits(i) => self.int(i)?,
            IntLit::Big => Val::BIG_INT,
        };
        self.push(v)
    }

    fn push_float(&mut self, f: f64) -> R<()> {
        let Ok(idx) = u32::try_from(self.store.floats.len()) else {
            return Err(PickleError::TooManyValues(self.max_values));
        };
        self.budget.room(&mut self.store.floats, 1).map_err(|e| self.over(e))?;
        self.store.floats.push(f);
        self.push(Val::float(idx))
    }

    fn grow_nodes(&mut self) -> R<()> {
        if NodeId::try_from(self.store.nodes.len()).is_err() {
            return Err(PickleError::TooManyValues(self.max_values));
        }
        self.budget.room(&mut self.store.nodes, 1).map_err(|e| self.over(e))?;
        self.budget.room(&mut self.store.roles, 1).map_err(|e| self.over(e))
    }

    fn new_node(&mut self, n: Node, role: Role) -> R<Val> {
        self.spend()?;
        self.grow_nodes()?;
        let id = self.store.nodes.len() as NodeId;
        self.store.nodes.push(n);
        self.store.roles.push(role);
        Ok(Val::node(id))
    }

    fn push_node(&mut self, n: Node) -> R<()> {
        let v = self.new_node(n, Role::Unknown)?;
        self.push(v)
    }

    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self) -> R<Val> {
        if self.stack.len() <= self.floor() {
            return self.fail("stack underflow");
        }
        Ok(self.stack.pop().unwrap_or(Val::NONE))
    }

    fn top(&self) -> R<Val> {
        if self.stack.len() <= self.floor() {
            return self.fail("stack underflow");
        }
        Ok(self.stack[self.stack.len() - 1])
    }

    /// Closes the last mark: the stack index where its items start.
    fn pop_mark(&mut self) -> R<usize> {
        match self.marks.pop() {
            Some(m) => Ok(m),
            None => self.fail("no MARK to pop to"),
        }
    }

    // -- roles --------------------------------------------------------------

    fn node_at(&self, v: Val) -> Option<&Node> {
        self.store.nodes.get(v.as_node()? as usize)
    }

    fn role_of(&self, v: Val) -> Role {
        v.as_node().and_then(|i| self.store.roles.get(i as usize)).copied().unwrap_or(Role::Unknown)
    }

    /// Items already in a list-like container (`None`: not list-like).
    fn list_len(&self, v: Val) -> Option<usize> {
        match self.node_at(v)? {
            Node::List(s) | Node::Head(s) => Some(s.len as usize),
            Node::Object(o) => Some(o.list.len()),
            Node::Skipped(Kind::List | Kind::Object) => Some(0),
            _ => None,
        }
    }

    /// Pairs already in a dict-like container (`None`: not dict-like).
    fn dict_len(&self, v: Val) -> Option<usize> {
        match self.node_at(v)? {
            Node::Dict(s) => Some(s.len as usize),
            Node::Object(o) => Some(o.items.len()),
            Node::Skipped(Kind::Dict | Kind::Object) => Some(0),
            _ => None,
        }
    }

    fn key_text(&self, v: Val) -> Option<&'a str> {
        match self.node_at(v)? {
            Node::Str(Text::Input { start, len }) => {
                std::str::from_utf8(&self.input[*start as usize..(*start + *len) as usize]).ok()
            }
            _ => None,
        }
    }

    /// The role of a container about to be pushed onto `stack[..base]`
    /// (see [`roles`]). Each pattern that could take it next gives a
    /// candidate: `APPEND` to an empty list right below, `SETITEM` of the
    /// key right below into an empty dict below it, `APPENDS`/`SETITEMS`
    /// into the container below the last mark. Candidates that disagree
    /// give `Unknown`, except that a known role wins over `Unused` (keeping
    /// too much is only memory; keeping too little costs a second parse).
    fn role_at(&self, base: usize) -> Role {
        if self.keep_all {
            return Role::Unknown;
        }
        let s = &self.stack[..base];
        let floor = self.floor().min(base);
        let mut guess: Option<Role> = None;
        let mut add = |r: Role| {
            guess = Some(match guess {
                None => r,
                Some(g) if g == r || r == Role::Unused => g,
                Some(Role::Unused) => r,
                Some(_) => Role::Unknown,
            })
        };
        if base > floor {
            let top = s[base - 1];
            if self.list_len(top) == Some(0) {
                add(self.role_of(top).child(Slot::Item(0)));
            }
            if base >= floor + 2 && self.dict_len(s[base - 2]) == Some(0) {
                if let Some(k) = self.key_text(top) {
                    add(self.role_of(s[base - 2]).child(Slot::Key(k)));
                }
            }
        }
        if let Some(&m) = self.marks.last().filter(|&&m| m >= 1 && m <= base) {
            let parent = s[m - 1];
            let pos = base - m;
            if let Some(len) = self.list_len(parent) {
                add(self.role_of(parent).child(Slot::Item(len + pos)));
            } else if self.dict_len(parent).is_some() && pos % 2 == 1 {
                // The value of the string key right below. (A key that is
                // no string, or a key position, means the container belongs
                // to one of the patterns above, or to none: no guess.)
                if let Some(k) = self.key_text(s[base - 1]) {
                    add(self.role_of(parent).child(Slot::Key(k)));
                }
            }
        }
        match guess {
            Some(r) => r,
            None if base == 0 && self.marks.is_empty() => Role::Root,
            None => Role::Unknown,
        }
    }

    // -- containers ---------------------------------------------------------

    /// Copies `stack[from..]` into a new span of `arena` (exactly sized).
    fn new_span<T: Copy>(
        budget: &mut Budget,
        arena: &mut Vec<T>,
        new: impl ExactSizeIterator<Item = T>,
    ) -> Result<Span, Exceeded> {
        let n = new.len();
        let start = arena.len();
        if u32::try_from(start + n).is_err() {
            return Err(Exceeded);
        }
        budget.room(arena, n)?;
        arena.extend(new);
        Ok(Span { start: start as u32, len: n as u32, cap: n as u32 })
    }

    /// Appends `new` to the span `s` of `arena` (see [`store`]: in place,
    /// at the end, or moved to the end with twice the room).
    fn extend_span<T: Copy>(
        budget: &mut Budget,
        arena: &mut Vec<T>,
        s: &mut Span,
        new: impl ExactSizeIterator<Item = T>,
        filler: T,
    ) -> Result<(), Exceeded> {
        let (start, len, cap, n) = (s.start as usize, s.len as usize, s.cap as usize, new.len());
        if len + n <= cap {
            for (slot, v) in arena[start + len..start + len + n].iter_mut().zip(new) {
                *slot = v;
            }
        } else if start + cap == arena.len() {
            if u32::try_from(start + len + n).is_err() {
                return Err(Exceeded);
            }
            budget.room(arena, len + n - cap)?;
            arena.truncate(start + len);
            arena.extend(new);
            s.cap = (len + n) as u32;
        } else {
            let room = (len + n).max(2 * len);
            let at = arena.len();
            if u32::try_from(at + room).is_err() {
                return Err(Exceeded);
            }
            budget.room(arena, room)?;
            arena.extend_from_within(start..start + len);
            arena.extend(new);
            arena.resize(at + room, filler);
            *s = Span { start: at as u32, len: len as u32, cap: room as u32 };
        }
        s.len = (len + n) as u32;
        Ok(())
    }

    /// Replaces `stack[from..]` by a new container of `kind` holding those
    /// items (pairs for a dict), placed by its role.
    fn container(&mut self, kind: Kind, from: usize) -> R<()> {
        let shape = match kind {
            Kind::List | Kind::Tuple => Shape::List,
            Kind::Dict => Shape::Dict,
            Kind::Set | Kind::Object => Shape::Any,
        };
        let role = self.role_at(from).fitting(shape);
        self.spend()?;
        let v = if role == Role::Unused {
            self.stack.truncate(from);
            Val::node(kind.skipped())
        } else {
            let budget = &mut *self.budget;
            let store = &mut self.store;
            let items = &self.stack[from..];
            let node = match kind {
                Kind::List if role == Role::Frames => {
                    let first = Self::new_span(budget, &mut store.items, items.iter().copied().take(1));
                    first.map(|s| Node::Head(Span { len: items.len() as u32, ..s }))
                }
                Kind::List => Self::new_span(budget, &mut store.items, items.iter().copied()).map(Node::List),
                Kind::Tuple => Self::new_span(budget, &mut store.items, items.iter().copied()).map(Node::Tuple),
                Kind::Set => Self::new_span(budget, &mut store.items, items.iter().copied()).map(Node::Set),
                Kind::Dict => {
                    let pairs = items.chunks_exact(2).map(|kv| (kv[0], kv[1]));
                    Self::new_span(budget, &mut store.pairs, pairs).map(Node::Dict)
                }
                Kind::Object => {
                    let size = std::mem::size_of::<Object>() as u64;
                    budget.charge(size).map(|()| Node::Object(Box::default()))
                }
            }
            .map_err(|e| self.over(e))?;
            self.stack.truncate(from);
            // Counted by `spend` above.
            self.values -= 1;
            self.new_node(node, role)?
        };
        self.push(v)
    }

    /// The node on top of the stack, for filling.
    fn target(&self, what: &str) -> R<usize> {
        let top = self.top()?;
        match top.as_node() {
            Some(id) => Ok(id as usize),
            None => self.fail(format!("{what} on a value that is not a container")),
        }
    }

    /// Appends `stack[from..]` to the list-like container below `from`.
    fn append(&mut self, from: usize) -> R<()> {
        let id = self.target_below(from, "APPEND")?;
        let (budget, store) = (&mut *self.budget, &mut self.store);
        let items = &self.stack[from..];
        let r = match &mut store.nodes[id] {
            Node::List(s) => Self::extend_span(budget, &mut store.items, s, items.iter().copied(), Val::HOLE),
            Node::Head(s) => if s.len == 0 && !items.is_empty() {
                let first = Self::new_span(budget, &mut store.items, items.iter().copied().take(1));
                first.map(|f| *s = Span { len: s.len, ..f })
            } else {
                Ok(())
            }
            .map(|()| s.len = s.len.saturating_add(items.len() as u32)),
            Node::Object(o) => budget.room(&mut o.list, items.len()).map(|()| o.list.extend_from_slice(items)),
            Node::Skipped(Kind::List | Kind::Object) => Ok(()),
            _ => return self.fail("APPEND to a value that is not a list"),
        };
        r.map_err(|e| self.over(e))?;
        self.stack.truncate(from);
        Ok(())
    }

    /// The container at `stack[from - 1]`, which must be above the floor.
    fn target_below(&mut self, from: usize, what: &str) -> R<usize> {
        if from == 0 || from <= self.floor() {
            return self.fail("stack underflow");
        }
        match self.stack[from - 1].as_node() {
            Some(id) => Ok(id as usize),
            None => self.fail(format!("{what} on a value that is not a container")),
        }
    }

    /// Sets the pairs `stack[from..]` on the dict-like container below.
    fn set_items(&mut self, from: usize) -> R<()> {
        if !(self.stack.len() - from).is_multiple_of(2) {
            return self.fail("odd number of items for a dict");
        }
        let id = self.target_below(from, "SETITEM")?;
        let (budget, store) = (&mut *self.budget, &mut self.store);
        let pairs = self.stack[from..].chunks_exact(2).map(|kv| (kv[0], kv[1]));
        let r = match &mut store.nodes[id] {
            Node::Dict(s) => Self::extend_span(budget, &mut store.pairs, s, pairs, (Val::HOLE, Val::HOLE)),
            Node::Object(o) => budget.room(&mut o.items, pairs.len()).map(|()| o.items.extend(pairs)),
            Node::Skipped(Kind::Dict | Kind::Object) => Ok(()),
            _ => return self.fail("SETITEM on a value that is not a dict"),
        };
        r.map_err(|e| self.over(e))?;
        self.stack.truncate(from);
        Ok(())
    }

    fn add_items(&mut self, from: usize) -> R<()> {
        let id = self.target_below(from, "ADDITEMS")?;
        let (budget, store) = (&mut *self.budget, &mut self.store);
        let items = &self.stack[from..];
        let r = match &mut store.nodes[id] {
            Node::Set(s) => Self::extend_span(budget, &mut store.items, s, items.iter().copied(), Val::HOLE),
            Node::Object(o) => budget.room(&mut o.list, items.len()).map(|()| o.list.extend_from_slice(items)),
            Node::Skipped(Kind::Set | Kind::Object) => Ok(()),
            _ => return self.fail("ADDITEMS to a value that is not a set"),
        };
        r.map_err(|e| self.over(e))?;
        self.stack.truncate(from);
        Ok(())
    }

    // -- memo ---------------------------------------------------------------

    fn memo_put(&mut self, id: u32) -> R<()> {
        let v = self.top()?;
        if self.memo.put(id, v, self.budget).map_err(|e| self.over(e))? {
            self.spend()?;
        }
        Ok(())
    }

    fn memo_get(&mut self, id: u32) -> R<()> {
        match self.memo.get(id) {
            Some(v) => self.push(v),
            None => self.fail(format!("memo key {id} not found")),
        }
    }

    fn text_memo_id(&mut self) -> R<u32> {
        let line = self.line()?;
        match std::str::from_utf8(line).ok().and_then(|s| s.trim().parse().ok()) {
            Some(id) => Ok(id),
            None => self.fail("invalid memo key"),
        }
    }

    // -- strings ------------------------------------------------------------

    fn str_node(&mut self, start: usize, len: usize) -> R<()> {
        if std::str::from_utf8(&self.input[start..start + len]).is_err() {
            return self.fail("string is not valid UTF-8");
        }
        self.push_node(Node::Str(Text::Input { start: start as u32, len: len as u32 }))
    }

    fn owned_str(&mut self, s: String) -> R<()> {
        let Ok(idx) = u32::try_from(self.store.owned.len()) else {
            return Err(PickleError::TooManyValues(self.max_values));
        };
        let bytes = s.len() as u64 + 16;
        self.budget.charge(bytes).map_err(|e| self.over(e))?;
        self.budget.room(&mut self.store.owned, 1).map_err(|e| self.over(e))?;
        self.store.owned.push(s.into_boxed_str());
        self.push_node(Node::Str(Text::Owned(idx)))
    }

    /// A length-prefixed UTF-8 string: the length was just read.
    fn unicode(&mut self, len: usize) -> R<()> {
        let start = self.pos;
        self.bytes(len)?;
        self.str_node(start, len)
    }

    /// A length-prefixed Python 2 `str`: text when it is UTF-8, else bytes.
    fn binstring(&mut self, len: usize) -> R<()> {
        let start = self.pos;
        let b = self.bytes(len)?;
        if std::str::from_utf8(b).is_ok() {
            self.push_node(Node::Str(Text::Input { start: start as u32, len: len as u32 }))
        } else {
            self.push_node(Node::Bytes)
        }
    }

    fn skip_bytes(&mut self, len: usize) -> R<()> {
        self.bytes(len)?;
        self.push_node(Node::Bytes)
    }

    /// An instance of `class` (never called), built from `args`.
    fn object(&mut self, class: Val, args: Option<Val>) -> R<()> {
        let from = self.stack.len();
        self.container(Kind::Object, from)?;
        let id = self.target("an object")?;
        if let Node::Object(o) = &mut self.store.nodes[id] {
            o.class = Some(class);
            o.args = args;
        }
        Ok(())
    }

    /// The `module` and `name` lines of `GLOBAL` and `INST`: a new
    /// [`Node::Global`] (not pushed).
    fn text_global(&mut self) -> R<Val> {
        let mut part = || -> R<NodeId> {
            let line = self.line()?;
            let start = line.as_ptr() as usize - self.input.as_ptr() as usize;
            if std::str::from_utf8(line).is_err() {
                return Ok(NO_NODE);
            }
            let text = Node::Str(Text::Input { start: start as u32, len: line.len() as u32 });
            Ok(self.new_node(text, Role::Unknown)?.as_node().unwrap_or(NO_NODE))
        };
        let module = part()?;
        let name = part()?;
        self.new_node(Node::Global { module, name }, Role::Unknown)
    }

    fn run(&mut self) -> R<Val> {
        loop {
            self.op_pos = self.pos;
            let op = match self.input.get(self.pos) {
                Some(&op) => op,
                None => return self.fail("truncated input (no STOP opcode)"),
            };
            self.pos += 1;
            match op {
                PROTO => {
                    let v = self.u8()?;
                    if v > 5 {
                        return self.fail(format!("unsupported pickle protocol {v}"));
                    }
                }
                FRAME => {
                    self.bytes(8)?;
                }
                STOP => return self.pop(),
                MARK => {
                    self.spend()?;
                    self.budget.room(&mut self.marks, 1).map_err(|e| self.over(e))?;
                    self.marks.push(self.stack.len());
                }
                POP => {
                    if self.stack.len() > self.floor() {
                        self.stack.pop();
                    } else {
                        let m = self.pop_mark()?;
                        self.stack.truncate(m);
                    }
                }
                POP_MARK => {
                    let m = self.pop_mark()?;
                    self.stack.truncate(m);
                }
                DUP => {
                    let v = self.top()?;
                    self.push(v)?;
                }
                PUT => {
                    let id = self.text_memo_id()?;
                    self.memo_put(id)?;
                }
                BINPUT => {
                    let id = self.u8()?;
                    self.memo_put(id.into())?;
                }
                LONG_BINPUT => {
                    let id = u32::from_le_bytes(self.array()?);
                    self.memo_put(id)?;
                }
                MEMOIZE => {
                    let id = match u32::try_from(self.memo.len()) {
                        Ok(id) => id,
                        Err(_) => return self.fail("memo is full"),
                    };
                    self.memo_put(id)?;
                }
                GET => {
                    let id = self.text_memo_id()?;
                    self.memo_get(id)?;
                }
                BINGET => {
                    let id = self.u8()?;
                    self.memo_get(id.into())?;
                }
                LONG_BINGET => {
                    let id = u32::from_le_bytes(self.array()?);
                    self.memo_get(id)?;
                }
                NONE => self.push(Val::NONE)?,
                NEWTRUE => self.push(Val::TRUE)?,
                NEWFALSE => self.push(Val::FALSE)?,
                INT => {
                    let line = self.line()?;
                    match line {
                        b"00" => self.push(Val::FALSE)?,
                        b"01" => self.push(Val::TRUE)?,
                        _ => match text_int(line) {
                            Some(lit) => self.push_int(lit)?,
                            None => return self.fail("invalid INT"),
                        },
                    }
                }
                LONG => {
                    let line = self.line()?;
                    let digits = line.strip_suffix(b"L").unwrap_or(line);
                    match text_int(digits) {
                        Some(lit) => self.push_int(lit)?,
                        None => return self.fail("invalid LONG"),
                    }
                }
                FLOAT => {
                    let line = self.line()?;
                    match std::str::from_utf8(line).ok().and_then(|s| s.trim().parse().ok()) {
                        Some(f) => self.push_float(f)?,
                        None => return self.fail("invalid FLOAT"),
                    }
                }
                BINFLOAT => {
                    let f = f64::from_be_bytes(self.array()?);
                    self.push_float(f)?;
                }
                BININT => {
                    let v = i32::from_le_bytes(self.array()?);
                    self.push_int(IntLit::Fits(v.into()))?;
                }
                BININT1 => {
                    let v = self.u8()?;
                    self.push_int(IntLit::Fits(v.into()))?;
                }
                BININT2 => {
                    let v = u16::from_le_bytes(self.array()?);
                    self.push_int(IntLit::Fits(v.into()))?;
                }
                LONG1 => {
                    let n = self.u8()?.into();
                    let b = self.bytes(n)?;
                    self.push_int(binary_int(b))?;
                }
                LONG4 => {
                    let n = self.i32_len()?;
                    let b = self.bytes(n)?;
                    self.push_int(binary_int(b))?;
                }
                STRING => {
                    let line = self.line()?;
                    match quoted_string(line) {
                        Some(Ok(s)) => self.owned_str(s)?,
                        Some(Err(())) => self.push_node(Node::Bytes)?,
                        None => return self.fail("the STRING opcode argument must be quoted"),
                    }
                }
                BINSTRING => {
                    let n = self.i32_len()?;
                    self.binstring(n)?;
                }
                SHORT_BINSTRING => {
                    let n = self.u8()?.into();
                    self.binstring(n)?;
                }
                UNICODE => {
                    let line = self.line()?;
                    match raw_unicode_escape(line) {
                        Some(s) => self.owned_str(s)?,
                        None => return self.fail("invalid UNICODE argument"),
                    }
                }
                BINUNICODE => {
                    let n = self.u32_len()?;
                    self.unicode(n)?;
                }
                SHORT_BINUNICODE => {
                    let n = self.u8()?.into();
                    self.unicode(n)?;
                }
                BINUNICODE8 => {
                    let n = self.u64_len()?;
                    self.unicode(n)?;
                }
                BINBYTES => {
                    let n = self.u32_len()?;
                    self.skip_bytes(n)?;
                }
                SHORT_BINBYTES => {
                    let n = self.u8()?.into();
                    self.skip_bytes(n)?;
                }
                BINBYTES8 | BYTEARRAY8 => {
                    let n = self.u64_len()?;
                    self.skip_bytes(n)?;
                }
                EMPTY_TUPLE => self.container(Kind::Tuple, self.stack.len())?,
                TUPLE1 | TUPLE2 | TUPLE3 => {
                    let n = usize::from(op - TUPLE1 + 1);
                    if self.stack.len() < self.floor() + n {
                        return self.fail("stack underflow");
                    }
                    self.container(Kind::Tuple, self.stack.len() - n)?;
                }
                TUPLE => {
                    let m = self.pop_mark()?;
                    self.container(Kind::Tuple, m)?;
                }
                EMPTY_LIST => self.container(Kind::List, self.stack.len())?,
                LIST => {
                    let m = self.pop_mark()?;
                    self.container(Kind::List, m)?;
                }
                APPEND => {
                    if self.stack.len() <= self.floor() {
                        return self.fail("stack underflow");
                    }
                    self.append(self.stack.len() - 1)?;
                }
                APPENDS => {
                    let m = self.pop_mark()?;
                    self.append(m)?;
                }
                EMPTY_DICT => self.container(Kind::Dict, self.stack.len())?,
                DICT => {
                    let m = self.pop_mark()?;
                    if !(self.stack.len() - m).is_multiple_of(2) {
                        return self.fail("odd number of items for a dict");
                    }
                    self.container(Kind::Dict, m)?;
                }
                SETITEM => {
                    if self.stack.len() < self.floor() + 2 {
                        return self.fail("stack underflow");
                    }
                    self.set_items(self.stack.len() - 2)?;
                }
                SETITEMS => {
                    let m = self.pop_mark()?;
                    self.set_items(m)?;
                }
                EMPTY_SET => self.container(Kind::Set, self.stack.len())?,
                FROZENSET => {
                    let m = self.pop_mark()?;
                    self.container(Kind::Set, m)?;
                }
                ADDITEMS => {
                    let m = self.pop_mark()?;
                    self.add_items(m)?;
                }
                GLOBAL => {
                    let class = self.text_global()?;
                    self.push(class)?;
                }
                STACK_GLOBAL => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let part = |v: Val| v.as_node().unwrap_or(NO_NODE);
                    self.push_node(Node::Global { module: part(module), name: part(name) })?;
                }
                REDUCE | NEWOBJ => {
                    let args = self.pop()?;
                    let class = self.pop()?;
                    self.object(class, Some(args))?;
                }
                NEWOBJ_EX => {
                    self.pop()?;
                    let args = self.pop()?;
                    let class = self.pop()?;
                    self.object(class, Some(args))?;
                }
                INST => {
                    let class = self.text_global()?;
                    let m = self.pop_mark()?;
                    self.stack.truncate(m);
                    self.object(class, None)?;
                }
                OBJ => {
                    let m = self.pop_mark()?;
                    if self.stack.len() == m {
                        return self.fail("OBJ without a class");
                    }
                    let class = self.stack[m];
                    self.stack.truncate(m);
                    self.object(class, None)?;
                }
                BUILD => {
                    let state = self.pop()?;
                    let id = self.target("BUILD")?;
                    if let Node::Object(o) = &mut self.store.nodes[id] {
                        o.state = Some(state);
                    }
                    // Building anything else (Python would call its
                    // __setstate__) leaves it as it is.
                }
                PERSID => {
                    self.line()?;
                    self.push_node(Node::Opaque)?;
                }
                BINPERSID => {
                    self.pop()?;
                    self.push_node(Node::Opaque)?;
                }
                EXT1 | EXT2 | EXT4 => {
                    let n = match op {
                        EXT1 => 1,
                        EXT2 => 2,
                        _ => 4,
                    };
                    self.bytes(n)?;
                    self.push_node(Node::Opaque)?;
                }
                NEXT_BUFFER => self.push_node(Node::Opaque)?,
                READONLY_BUFFER => {
                    self.top()?;
                }
                other => return self.fail(format!("unknown opcode 0x{other:02x}")),
            }
        }
    }
}

/// An integer literal: fits `i64` or not (its digits are then not kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IntLit {
    Fits(i64),
    Big,
}

/// A decimal integer in text form (`INT`, `LONG`).
fn text_int(line: &[u8]) -> Option<IntLit> {
    let s = std::str::from_utf8(line).ok()?.trim();
    let digits = s.strip_prefix(['-', '+']).unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(s.parse::<i64>().map_or(IntLit::Big, IntLit::Fits))
}

/// A little-endian two's-complement integer (`LONG1`, `LONG4`).
fn binary_int(b: &[u8]) -> IntLit {
    let mut b = b;
    // Drop sign-extension bytes that do not change the value.
    while b.len() > 8 {
        let (last, prev) = (b[b.len() - 1], b[b.len() - 2]);
        let redundant = (last == 0x00 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0);
        if !redundant {
            return IntLit::Big;
        }
        b = &b[..b.len() - 1];
    }
    if b.is_empty() {
        return IntLit::Fits(0);
    }
    let negative = b[b.len() - 1] & 0x80 != 0;
    let mut buf = if negative { [0xff; 8] } else { [0; 8] };
    buf[..b.len()].copy_from_slice(b);
    IntLit::Fits(i64::from_le_bytes(buf))
}

/// The argument of `STRING`: a quoted Python 2 string literal. `None` when it
/// is not quoted; `Err` when its bytes are not UTF-8.
fn quoted_string(line: &[u8]) -> Option<Result<String, ()>> {
    let q = *line.first()?;
    if line.len() < 2 || (q != b'\'' && q != b'"') || line[line.len() - 1] != q {
        return None;
    }
    let body = &line[1..line.len() - 1];
    let mut out = Vec::with_capacity(body.len());
    let mut i = 0;
    while i < body.len() {
        let c = body[i];
        i += 1;
        if c != b'\\' || i == body.len() {
            out.push(c);
            continue;
        }
        let e = body[i];
        i += 1;
        match e {
            b'n' => out.push(b'\n'),
            b'r' => out.push(b'\r'),
            b't' => out.push(b'\t'),
            b'\\' | b'\'' | b'"' => out.push(e),
            b'x' if i + 2 <= body.len() => {
                match std::str::from_utf8(&body[i..i + 2]).ok().and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => out.extend_from_slice(b"\\x"),
                }
            }
            _ => {
                out.push(b'\\');
                out.push(e);
            }
        }
    }
    Some(String::from_utf8(out).map_err(|_| ()))
}

/// The argument of `UNICODE`: latin-1 text with `\uXXXX` / `\UXXXXXXXX`
/// escapes (Python's `raw-unicode-escape`).
fn raw_unicode_escape(line: &[u8]) -> Option<String> {
    let mut out = String::with_capacity(line.len());
    let mut i = 0;
    while i < line.len() {
        let c = line[i];
        if c == b'\\' && i + 1 < line.len() && (line[i + 1] == b'u' || line[i + 1] == b'U') {
            let n = if line[i + 1] == b'u' { 4 } else { 8 };
            let hex = line.get(i + 2..i + 2 + n)?;
            let code = u32::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?;
            out.push(char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER));
            i += 2 + n;
        } else {
            out.push(char::from(c));
            i += 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::store::Scalar;
    use super::*;

    fn parse_with(bytes: &[u8], max_values: usize, keep_all: bool) -> Result<Pickle<'_>, PickleError> {
        parse(bytes, max_values, &mut Budget::new(u64::MAX), keep_all)
    }

    fn p(bytes: &[u8]) -> Result<Pickle<'_>, PickleError> {
        parse_with(bytes, 1_000_000, true)
    }

    fn scalars(pk: &Pickle<'_>, vals: &[Val]) -> Vec<Scalar> {
        vals.iter().map(|&v| pk.scalar(v)).collect()
    }

    fn short_str(b: &mut Vec<u8>, s: &str) {
        b.push(SHORT_BINUNICODE);
        b.push(s.len() as u8);
        b.extend_from_slice(s.as_bytes());
    }

    #[test]
    fn protocol_4_dict() {
        // pickle.dumps({"a": [1, -2, 2**40, "x"], "b": (None, True, 1.5)}, protocol=4)
        let bytes = b"\x80\x04\x951\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01J\xfe\xff\xff\xff\x8a\x06\x00\x00\x00\x00\x00\x01\x8c\x01x\x94e\x8c\x01b\x94N\x88G?\xf8\x00\x00\x00\x00\x00\x00\x87\x94u.";
        for keep_all in [true, false] {
            let pk = parse_with(bytes, 1000, keep_all).unwrap();
            let d = pk.as_dict(pk.root).unwrap();
            assert_eq!(pk.as_str(d[0].0), Some("a"));
            assert_eq!(pk.as_str(d[1].0), Some("b"));
            if !keep_all {
                // Keys that are not the snapshot's: not kept, and a reader
                // that asks learns it.
                assert!(!pk.touched_skipped());
                assert!(pk.as_list(d[0].1).is_none());
                assert!(pk.touched_skipped());
                continue;
            }
            let l = pk.as_list(d[0].1).unwrap();
            assert_eq!(
                l[..3].iter().map(|&v| pk.as_int(v)).collect::<Vec<_>>(),
                vec![Some(1), Some(-2), Some(1 << 40)]
            );
            assert_eq!(pk.as_str(l[3]), Some("x"));
            let t = pk.as_list(d[1].1).unwrap();
            assert_eq!(scalars(&pk, t), [Scalar::None, Scalar::Bool(true), Scalar::Float(1.5)]);
            assert!(!pk.touched_skipped());
        }
    }

    #[test]
    fn protocol_0_text() {
        // pickle.dumps({"k": [1, 2**70, "s\u00e9"]}, protocol=0)
        let bytes = b"(dp0\nVk\np1\n(lp2\nI1\naL1180591620717411303424L\naVs\xe9\np3\nas.";
        let pk = p(bytes).unwrap();
        let d = pk.as_dict(pk.root).unwrap();
        assert_eq!(pk.as_str(d[0].0), Some("k"));
        let l = pk.as_list(d[0].1).unwrap();
        assert_eq!(scalars(&pk, &l[..2]), [Scalar::Int(1), Scalar::BigInt]);
        assert_eq!(pk.as_str(l[2]), Some("sé"));
    }

    #[test]
    fn integers_of_every_width() {
        let mut b = vec![PROTO, 4, MARK];
        let ints = [0i64, -1, (1 << 60) - 1, -(1 << 60), 1 << 60, -(1 << 60) - 1, i64::MAX, i64::MIN];
        for i in ints {
            b.push(LONG1);
            b.push(8);
            b.extend_from_slice(&i.to_le_bytes());
        }
        b.extend_from_slice(&[LIST, STOP]);
        let pk = p(&b).unwrap();
        let got: Vec<Option<i64>> = pk.as_list(pk.root).unwrap().iter().map(|&v| pk.as_int(v)).collect();
        assert_eq!(got, ints.map(Some));
        assert_eq!(pk.store.wide.len(), 4, "only the wide ones are boxed");
    }

    #[test]
    fn long_ints() {
        assert_eq!(binary_int(&[]), IntLit::Fits(0));
        assert_eq!(binary_int(&[0xff]), IntLit::Fits(-1));
        assert_eq!(binary_int(&[0x00, 0x80]), IntLit::Fits(-32768));
        assert_eq!(binary_int(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 0x00]), IntLit::Fits(i64::MAX));
        assert_eq!(binary_int(&[0, 0, 0, 0, 0, 0, 0, 0x80, 0x00]), IntLit::Big);
        assert_eq!(binary_int(&[0, 0, 0, 0, 0, 0, 0, 0x80, 0xff]), IntLit::Fits(i64::MIN));
        assert_eq!(text_int(b"-12"), Some(IntLit::Fits(-12)));
        assert_eq!(text_int(b"99999999999999999999"), Some(IntLit::Big));
        assert_eq!(text_int(b"1x"), None);
    }

    #[test]
    fn memo_is_shared_not_copied() {
        // A "billion laughs": l0 = [0]; l(k+1) = [l(k), l(k)] 60 times.
        let mut b = vec![0x80, 4, b']', 0x94, b'K', 0, b'a'];
        for k in 0..60u32 {
            b.extend_from_slice(&[b']', 0x94, b'(', b'j']);
            b.extend_from_slice(&k.to_le_bytes());
            b.push(b'j');
            b.extend_from_slice(&k.to_le_bytes());
            b.push(b'e');
        }
        b.push(b'.');
        let pk = parse_with(&b, 10_000, true).unwrap();
        assert!(pk.store.nodes.len() < 100);
        let mut v = pk.root;
        for _ in 0..60 {
            let l = pk.as_list(v).unwrap();
            assert_eq!(l.len(), 2);
            v = l[1];
        }
        assert_eq!(scalars(&pk, pk.as_list(v).unwrap()), [Scalar::Int(0)]);
    }

    #[test]
    fn sparse_memo_ids() {
        // PUT ids far apart, then MEMOIZE (which numbers by count), then GETs.
        let mut b = vec![PROTO, 4, BININT1, 7, LONG_BINPUT];
        b.extend_from_slice(&1_000_000_000u32.to_le_bytes());
        b.extend_from_slice(&[BININT1, 8, BINPUT, 3, BININT1, 9, MEMOIZE, BININT1, 10, BINPUT, 3, MARK, LONG_BINGET]);
        b.extend_from_slice(&1_000_000_000u32.to_le_bytes());
        b.extend_from_slice(&[BINGET, 2, BINGET, 3, LIST, STOP]);
        let pk = p(&b).unwrap();
        // MEMOIZE gave id 2 (two entries before it); PUT 3 was overwritten.
        assert_eq!(scalars(&pk, pk.as_list(pk.root).unwrap()), [Scalar::Int(7), Scalar::Int(9), Scalar::Int(10)]);
    }

    #[test]
    fn unused_parts_are_not_kept() {
        // {"segments": [{"blocks": [{"frames": [f0, f1, f0]}]}], "junk": [[[]], {"a": []}]}
        let mut b = vec![PROTO, 4, EMPTY_DICT, MEMOIZE, MARK];
        short_str(&mut b, "segments");
        b.extend_from_slice(&[EMPTY_LIST, EMPTY_DICT]);
        short_str(&mut b, "blocks");
        b.extend_from_slice(&[EMPTY_LIST, EMPTY_DICT]);
        short_str(&mut b, "frames");
        b.extend_from_slice(&[EMPTY_LIST, MARK, EMPTY_DICT, MEMOIZE]);
        short_str(&mut b, "name");
        short_str(&mut b, "f0");
        b.extend_from_slice(&[SETITEM, EMPTY_DICT]);
        short_str(&mut b, "name");
        short_str(&mut b, "f1");
        b.extend_from_slice(&[SETITEM, BINGET, 1, APPENDS, SETITEM, APPEND, SETITEM, APPEND]);
        short_str(&mut b, "junk");
        b.extend_from_slice(&[EMPTY_LIST, MARK, EMPTY_LIST, EMPTY_LIST, APPEND, EMPTY_DICT]);
        short_str(&mut b, "a");
        b.extend_from_slice(&[EMPTY_LIST, SETITEM, APPENDS, SETITEMS, STOP]);

        let full = parse_with(&b, 1000, true).unwrap();
        let lean = parse_with(&b, 1000, false).unwrap();
        assert!(lean.store.nodes.len() < full.store.nodes.len());
        assert!(lean.store.items.len() < full.store.items.len());
        for pk in [&full, &lean] {
            let top = pk.as_dict(pk.root).unwrap();
            assert_eq!(top.len(), 2);
            let segs = pk.as_list(top[0].1).unwrap();
            let blocks = pk.as_dict(segs[0]).unwrap();
            let block = pk.as_dict(pk.as_list(blocks[0].1).unwrap()[0]).unwrap();
            let f0 = pk.first_item(block[0].1).unwrap();
            assert_eq!(pk.as_str(pk.as_dict(f0).unwrap()[0].1), Some("f0"));
            assert!(!pk.touched_skipped());
        }
        // What the import does not read is marked, and reading it says so.
        assert_eq!(lean.type_name(lean.as_dict(lean.root).unwrap()[1].1), "list");
        assert!(lean.touched_skipped());
        let lean = parse_with(&b, 1000, false).unwrap();
        let seg = lean.as_list(lean.as_dict(lean.root).unwrap()[0].1).unwrap()[0];
        let block = lean.as_list(lean.as_dict(seg).unwrap()[0].1).unwrap()[0];
        let frames = lean.as_dict(block).unwrap()[0].1;
        assert!(!lean.touched_skipped());
        assert!(lean.as_list(frames).is_none(), "only the first frame is kept");
        assert!(lean.touched_skipped());
        assert_eq!(full.as_list(frames).unwrap().len(), 3);
    }

    #[test]
    fn nothing_of_an_unused_subtree_is_kept() {
        // {"junk": [[[[…]]]] (1000 deep), "more": [[], [], …] (1000)}: the
        // nodes and items of both stay at what the top level needs.
        let mut b = vec![PROTO, 4, EMPTY_DICT, MEMOIZE, MARK];
        short_str(&mut b, "junk");
        b.push(MEMOIZE);
        for _ in 0..1000 {
            b.extend_from_slice(&[EMPTY_LIST, MEMOIZE]);
        }
        b.extend(std::iter::repeat_n(APPEND, 999));
        short_str(&mut b, "more");
        b.extend_from_slice(&[EMPTY_LIST, MEMOIZE, MARK]);
        for _ in 0..1000 {
            b.extend_from_slice(&[EMPTY_LIST, MEMOIZE]);
        }
        b.extend_from_slice(&[APPENDS, SETITEMS, STOP]);
        let pk = parse_with(&b, 100_000, false).unwrap();
        assert_eq!(pk.store.nodes.len(), Kind::ALL.len() + 3, "the root and two keys");
        assert_eq!(pk.store.items.len(), 0);
        assert_eq!(pk.as_dict(pk.root).unwrap().len(), 2);
        let full = parse_with(&b, 100_000, true).unwrap();
        assert_eq!(full.store.nodes.len(), Kind::ALL.len() + 3 + 2001);
    }

    #[test]
    fn skipped_containers_fail_like_the_real_ones() {
        // {"junk": {}} then APPEND to the dict: an error with or without skipping.
        let mut b = vec![PROTO, 4, EMPTY_DICT, MARK];
        short_str(&mut b, "junk");
        b.extend_from_slice(&[EMPTY_DICT, BININT1, 1, APPEND, SETITEMS, STOP]);
        for keep_all in [true, false] {
            let e = parse_with(&b, 1000, keep_all).err().unwrap().to_string();
            assert_eq!(e, "malformed pickle at byte 13: APPEND to a value that is not a list");
        }
    }

    #[test]
    fn memory_is_charged_before_it_is_used() {
        let b: Vec<u8> =
            [PROTO, 4, MARK].into_iter().chain(std::iter::repeat_n(NONE, 10_000)).chain([LIST, STOP]).collect();
        let mut budget = Budget::new(u64::MAX);
        let pk = parse(&b, 1_000_000, &mut budget, true).unwrap();
        assert_eq!(pk.as_list(pk.root).unwrap().len(), 10_000);
        let peak = budget.peak();
        assert!(peak >= 10_000 * 8 * 2, "stack and items: {peak}");
        assert!(peak <= 10_000 * 8 * 5, "{peak}");
        let mut small = Budget::new(peak / 2);
        assert_eq!(
            parse(&b, 1_000_000, &mut small, true).err().unwrap(),
            PickleError::MemoryLimit { limit: peak / 2, offset: 8195 }
        );
    }

    #[test]
    fn errors() {
        let e = |b: &[u8]| p(b).err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(e(b""), "malformed pickle at byte 0: truncated input (no STOP opcode)");
        assert_eq!(e(b"\x80\x04"), "malformed pickle at byte 2: truncated input (no STOP opcode)");
        assert_eq!(e(b"."), "malformed pickle at byte 0: stack underflow");
        assert_eq!(e(b"]K\x01K\x02(K\x03a."), "malformed pickle at byte 8: stack underflow");
        assert_eq!(e(b"K\x01a."), "malformed pickle at byte 2: stack underflow");
        assert_eq!(e(b"K\x01K\x01a."), "malformed pickle at byte 4: APPEND on a value that is not a container");
        assert_eq!(e(b"}K\x01a."), "malformed pickle at byte 3: APPEND to a value that is not a list");
        assert_eq!(e(b"h\x05."), "malformed pickle at byte 0: memo key 5 not found");
        assert_eq!(e(b"\xff."), "malformed pickle at byte 0: unknown opcode 0xff");
        assert_eq!(e(b"\x80\x09."), "malformed pickle at byte 0: unsupported pickle protocol 9");
        assert_eq!(e(b"X\xff\xff\xff\xffabc."), "malformed pickle at byte 0: truncated input");
        assert_eq!(e(b"\x8c\x02\xc3\x28."), "malformed pickle at byte 0: string is not valid UTF-8");
        assert_eq!(e(b"}(K\x01u."), "malformed pickle at byte 4: odd number of items for a dict");
        assert_eq!(e(b"e."), "malformed pickle at byte 0: no MARK to pop to");
        assert_eq!(e(b"Sabc\n."), "malformed pickle at byte 0: the STRING opcode argument must be quoted");
        assert_eq!(e(b"}K\x01s."), "malformed pickle at byte 3: stack underflow");
        assert_eq!(e(b"K\x01K\x02K\x03s."), "malformed pickle at byte 6: SETITEM on a value that is not a container");
        assert_eq!(
            parse_with(b"]]]]]].", 3, true).err().unwrap().to_string(),
            "the pickle holds more than 3 values (raise ImportLimits::max_values)"
        );
        // Trailing bytes after STOP are ignored, as in Python.
        assert!(p(b"N.garbage").is_ok());
    }
}
