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
//! arena and are shared, nothing is recursive.
//!
//! Bounds (both hold for any input):
//! - memory is linear in the input: every opcode adds at most one value slot
//!   (16 bytes) or one arena node, and the total is capped by `max_values`;
//! - time is linear in the input: no opcode does work proportional to
//!   anything but its own argument, except those that move items popped
//!   off the stack, and each item is moved at most once.
//!
//! Classes and functions (`GLOBAL`, `REDUCE`, `NEWOBJ`, …) are never called:
//! they become opaque [`Node::Object`]s that keep the items and state the
//! pickle gives them, so that a dict subclass still reads as a dict.

use std::fmt;

use rustc_hash::FxHashMap;

/// Index of a [`Node`] in [`Pickle::nodes`].
pub(crate) type NodeId = u32;

/// A value: scalars inline, everything else a reference to an arena node.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Val {
    None,
    Bool(bool),
    Int(i64),
    /// An integer that does not fit `i64` (its digits are not kept).
    BigInt,
    Float(f64),
    Ref(NodeId),
}

/// A string's text: a range of the input (binary opcodes) or decoded text.
#[derive(Debug)]
pub(crate) enum Text {
    Input { start: usize, len: usize },
    Owned(Box<str>),
}

/// An object in the arena.
#[derive(Debug)]
pub(crate) enum Node {
    Str(Text),
    /// A `bytes` or `bytearray` (its contents are not kept).
    Bytes,
    List(Vec<Val>),
    Tuple(Vec<Val>),
    Dict(Vec<(Val, Val)>),
    Set(Vec<Val>),
    /// A reference to a class or function (never resolved).
    Global,
    /// An instance built by `REDUCE`/`NEWOBJ`/`OBJ`/`INST`/`BUILD`.
    Object(Box<Object>),
    /// Something else opaque (persistent ids, extension codes, buffers).
    Opaque,
}

/// The parts of an opaque instance that the pickle gives it.
#[derive(Debug, Default)]
pub(crate) struct Object {
    /// Items set on it as if it were a dict (`SETITEM(S)`).
    pub(crate) items: Vec<(Val, Val)>,
    /// Items appended to it as if it were a list (`APPEND(S)`, `ADDITEMS`).
    pub(crate) list: Vec<Val>,
    /// Its `__setstate__` argument (`BUILD`).
    pub(crate) state: Option<Val>,
}

/// Why a pickle was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PickleError {
    /// Malformed input at a byte offset.
    At { offset: usize, message: String },
    /// The input holds more values than the configured limit.
    TooManyValues(usize),
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
        }
    }
}

/// A parsed pickle: the arena and the root value.
pub(crate) struct Pickle<'a> {
    input: &'a [u8],
    nodes: Vec<Node>,
    /// The value the pickle stops with.
    pub(crate) root: Val,
}

impl<'a> Pickle<'a> {
    fn node(&self, v: Val) -> Option<&Node> {
        match v {
            Val::Ref(id) => self.nodes.get(id as usize),
            _ => None,
        }
    }

    /// The text of a `str`.
    pub(crate) fn as_str(&self, v: Val) -> Option<&str> {
        match self.node(v)? {
            Node::Str(Text::Owned(s)) => Some(s),
            Node::Str(Text::Input { start, len }) => {
                // Validated as UTF-8 when parsed.
                std::str::from_utf8(self.input.get(*start..start + len)?).ok()
            }
            _ => None,
        }
    }

    /// The value of an `int` that fits `i64`.
    pub(crate) fn as_int(&self, v: Val) -> Option<i64> {
        match v {
            Val::Int(i) => Some(i),
            _ => None,
        }
    }

    /// The items of a list, tuple or set (or of an object filled like a list).
    pub(crate) fn as_list(&self, v: Val) -> Option<&[Val]> {
        match self.node(v)? {
            Node::List(items) | Node::Tuple(items) | Node::Set(items) => Some(items),
            Node::Object(o) if !o.list.is_empty() => Some(&o.list),
            Node::Object(o) => match o.state.and_then(|s| self.node(s)) {
                Some(Node::List(items)) => Some(items),
                _ => None,
            },
            _ => None,
        }
    }

    /// The pairs of a dict (or of an object filled like a dict, or whose
    /// state is a dict, such as an `OrderedDict`).
    pub(crate) fn as_dict(&self, v: Val) -> Option<&[(Val, Val)]> {
        match self.node(v)? {
            Node::Dict(items) => Some(items),
            Node::Object(o) if !o.items.is_empty() => Some(&o.items),
            Node::Object(o) => match o.state.and_then(|s| self.node(s)) {
                Some(Node::Dict(items)) => Some(items),
                _ if o.list.is_empty() => Some(&o.items),
                _ => None,
            },
            _ => None,
        }
    }

    /// A short Python-ish name of the value's type, for error messages.
    pub(crate) fn type_name(&self, v: Val) -> &'static str {
        match v {
            Val::None => "None",
            Val::Bool(_) => "bool",
            Val::Int(_) => "int",
            Val::BigInt => "int (too large)",
            Val::Float(_) => "float",
            Val::Ref(_) => match self.node(v) {
                Some(Node::Str(_)) => "str",
                Some(Node::Bytes) => "bytes",
                Some(Node::List(_)) => "list",
                Some(Node::Tuple(_)) => "tuple",
                Some(Node::Dict(_)) => "dict",
                Some(Node::Set(_)) => "set",
                Some(Node::Global) => "class",
                Some(Node::Object(_)) => "object",
                Some(Node::Opaque) | None => "opaque object",
            },
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

/// Parses `input` (trailing bytes after `STOP` are ignored, as Python does).
pub(crate) fn parse(input: &[u8], max_values: usize) -> Result<Pickle<'_>, PickleError> {
    let mut p = Parser {
        input,
        pos: 0,
        op_pos: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: FxHashMap::default(),
        nodes: Vec::new(),
        values: 0,
        max_values,
    };
    let root = p.run()?;
    Ok(Pickle { input, nodes: p.nodes, root })
}

struct Parser<'a> {
    input: &'a [u8],
    pos: usize,
    /// Offset of the opcode being executed (for errors).
    op_pos: usize,
    stack: Vec<Val>,
    /// Stack lengths at each `MARK` still open.
    marks: Vec<usize>,
    memo: FxHashMap<u32, Val>,
    nodes: Vec<Node>,
    /// Value slots created so far (stack pushes, nodes, marks, memo entries).
    values: usize,
    max_values: usize,
}

type R<T> = Result<T, PickleError>;

impl<'a> Parser<'a> {
    fn fail<T>(&self, message: impl Into<String>) -> R<T> {
        Err(PickleError::At { offset: self.op_pos, message: message.into() })
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
        match rest.iter().position(|&b| b == b'\n') {
            Some(i) => {
                self.pos += i + 1;
                Ok(&rest[..i])
            }
            None => self.fail("truncated input (no end of line)"),
        }
    }

    fn push(&mut self, v: Val) -> R<()> {
        self.spend()?;
        self.stack.push(v);
        Ok(())
    }

    fn new_node(&mut self, n: Node) -> R<Val> {
        self.spend()?;
        let id = match NodeId::try_from(self.nodes.len()) {
            Ok(id) => id,
            Err(_) => return Err(PickleError::TooManyValues(self.max_values)),
        };
        self.nodes.push(n);
        Ok(Val::Ref(id))
    }

    fn push_node(&mut self, n: Node) -> R<()> {
        let v = self.new_node(n)?;
        self.push(v)
    }

    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self) -> R<Val> {
        if self.stack.len() <= self.floor() {
            return self.fail("stack underflow");
        }
        Ok(self.stack.pop().unwrap_or(Val::None))
    }

    fn top(&self) -> R<Val> {
        if self.stack.len() <= self.floor() {
            return self.fail("stack underflow");
        }
        Ok(self.stack[self.stack.len() - 1])
    }

    fn pop_mark(&mut self) -> R<Vec<Val>> {
        match self.marks.pop() {
            Some(m) => Ok(self.stack.split_off(m)),
            None => self.fail("no MARK to pop to"),
        }
    }

    fn top_node(&mut self, what: &str) -> R<&mut Node> {
        let top = self.top()?;
        match top {
            Val::Ref(id) => Ok(&mut self.nodes[id as usize]),
            _ => self.fail(format!("{what} on a value that is not a container")),
        }
    }

    fn append(&mut self, items: Vec<Val>) -> R<()> {
        match self.top_node("APPEND")? {
            Node::List(l) => l.extend(items),
            Node::Object(o) => o.list.extend(items),
            _ => return self.fail("APPEND to a value that is not a list"),
        }
        Ok(())
    }

    fn set_items(&mut self, items: Vec<Val>) -> R<()> {
        if !items.len().is_multiple_of(2) {
            return self.fail("odd number of items for a dict");
        }
        let pairs = items.chunks_exact(2).map(|kv| (kv[0], kv[1]));
        match self.top_node("SETITEM")? {
            Node::Dict(d) => d.extend(pairs),
            Node::Object(o) => o.items.extend(pairs),
            _ => return self.fail("SETITEM on a value that is not a dict"),
        }
        Ok(())
    }

    fn memo_put(&mut self, id: u32) -> R<()> {
        let v = self.top()?;
        if self.memo.insert(id, v).is_none() {
            self.spend()?;
        }
        Ok(())
    }

    fn memo_get(&mut self, id: u32) -> R<()> {
        match self.memo.get(&id) {
            Some(&v) => self.push(v),
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

    fn str_node(&mut self, start: usize, len: usize) -> R<()> {
        if std::str::from_utf8(&self.input[start..start + len]).is_err() {
            return self.fail("string is not valid UTF-8");
        }
        self.push_node(Node::Str(Text::Input { start, len }))
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
            self.push_node(Node::Str(Text::Input { start, len }))
        } else {
            self.push_node(Node::Bytes)
        }
    }

    fn skip_bytes(&mut self, len: usize) -> R<()> {
        self.bytes(len)?;
        self.push_node(Node::Bytes)
    }

    fn object(&mut self) -> R<()> {
        self.push_node(Node::Object(Box::default()))
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
                    self.marks.push(self.stack.len());
                }
                POP => {
                    if self.stack.len() > self.floor() {
                        self.stack.pop();
                    } else {
                        self.pop_mark()?;
                    }
                }
                POP_MARK => {
                    self.pop_mark()?;
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
                NONE => self.push(Val::None)?,
                NEWTRUE => self.push(Val::Bool(true))?,
                NEWFALSE => self.push(Val::Bool(false))?,
                INT => {
                    let line = self.line()?;
                    let v = match line {
                        b"00" => Val::Bool(false),
                        b"01" => Val::Bool(true),
                        _ => match text_int(line) {
                            Some(v) => v,
                            None => return self.fail("invalid INT"),
                        },
                    };
                    self.push(v)?;
                }
                LONG => {
                    let line = self.line()?;
                    let digits = line.strip_suffix(b"L").unwrap_or(line);
                    match text_int(digits) {
                        Some(v) => self.push(v)?,
                        None => return self.fail("invalid LONG"),
                    }
                }
                FLOAT => {
                    let line = self.line()?;
                    match std::str::from_utf8(line).ok().and_then(|s| s.trim().parse().ok()) {
                        Some(f) => self.push(Val::Float(f))?,
                        None => return self.fail("invalid FLOAT"),
                    }
                }
                BINFLOAT => {
                    let f = f64::from_be_bytes(self.array()?);
                    self.push(Val::Float(f))?;
                }
                BININT => {
                    let v = i32::from_le_bytes(self.array()?);
                    self.push(Val::Int(v.into()))?;
                }
                BININT1 => {
                    let v = self.u8()?;
                    self.push(Val::Int(v.into()))?;
                }
                BININT2 => {
                    let v = u16::from_le_bytes(self.array()?);
                    self.push(Val::Int(v.into()))?;
                }
                LONG1 => {
                    let n = self.u8()?.into();
                    let b = self.bytes(n)?;
                    self.push(binary_int(b))?;
                }
                LONG4 => {
                    let n = self.i32_len()?;
                    let b = self.bytes(n)?;
                    self.push(binary_int(b))?;
                }
                STRING => {
                    let line = self.line()?;
                    match quoted_string(line) {
                        Some(Ok(s)) => self.push_node(Node::Str(Text::Owned(s.into())))?,
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
                        Some(s) => self.push_node(Node::Str(Text::Owned(s.into())))?,
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
                EMPTY_TUPLE => self.push_node(Node::Tuple(Vec::new()))?,
                TUPLE1 | TUPLE2 | TUPLE3 => {
                    let n = usize::from(op - TUPLE1 + 1);
                    if self.stack.len() < self.floor() + n {
                        return self.fail("stack underflow");
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.push_node(Node::Tuple(items))?;
                }
                TUPLE => {
                    let items = self.pop_mark()?;
                    self.push_node(Node::Tuple(items))?;
                }
                EMPTY_LIST => self.push_node(Node::List(Vec::new()))?,
                LIST => {
                    let items = self.pop_mark()?;
                    self.push_node(Node::List(items))?;
                }
                APPEND => {
                    let v = self.pop()?;
                    self.append(vec![v])?;
                }
                APPENDS => {
                    let items = self.pop_mark()?;
                    self.append(items)?;
                }
                EMPTY_DICT => self.push_node(Node::Dict(Vec::new()))?,
                DICT => {
                    let items = self.pop_mark()?;
                    if !items.len().is_multiple_of(2) {
                        return self.fail("odd number of items for a dict");
                    }
                    let pairs = items.chunks_exact(2).map(|kv| (kv[0], kv[1])).collect();
                    self.push_node(Node::Dict(pairs))?;
                }
                SETITEM => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.set_items(vec![k, v])?;
                }
                SETITEMS => {
                    let items = self.pop_mark()?;
                    self.set_items(items)?;
                }
                EMPTY_SET => self.push_node(Node::Set(Vec::new()))?,
                FROZENSET => {
                    let items = self.pop_mark()?;
                    self.push_node(Node::Set(items))?;
                }
                ADDITEMS => {
                    let items = self.pop_mark()?;
                    match self.top_node("ADDITEMS")? {
                        Node::Set(s) => s.extend(items),
                        Node::Object(o) => o.list.extend(items),
                        _ => return self.fail("ADDITEMS to a value that is not a set"),
                    }
                }
                GLOBAL => {
                    self.line()?;
                    self.line()?;
                    self.push_node(Node::Global)?;
                }
                STACK_GLOBAL => {
                    self.pop()?;
                    self.pop()?;
                    self.push_node(Node::Global)?;
                }
                REDUCE | NEWOBJ => {
                    self.pop()?;
                    self.pop()?;
                    self.object()?;
                }
                NEWOBJ_EX => {
                    self.pop()?;
                    self.pop()?;
                    self.pop()?;
                    self.object()?;
                }
                INST => {
                    self.line()?;
                    self.line()?;
                    self.pop_mark()?;
                    self.object()?;
                }
                OBJ => {
                    let args = self.pop_mark()?;
                    if args.is_empty() {
                        return self.fail("OBJ without a class");
                    }
                    self.object()?;
                }
                BUILD => {
                    let state = self.pop()?;
                    if let Node::Object(o) = self.top_node("BUILD")? {
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

/// A decimal integer in text form (`INT`, `LONG`).
fn text_int(line: &[u8]) -> Option<Val> {
    let s = std::str::from_utf8(line).ok()?.trim();
    let digits = s.strip_prefix(['-', '+']).unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(s.parse::<i64>().map_or(Val::BigInt, Val::Int))
}

/// A little-endian two's-complement integer (`LONG1`, `LONG4`).
fn binary_int(b: &[u8]) -> Val {
    let mut b = b;
    // Drop sign-extension bytes that do not change the value.
    while b.len() > 8 {
        let (last, prev) = (b[b.len() - 1], b[b.len() - 2]);
        let redundant = (last == 0x00 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0);
        if !redundant {
            return Val::BigInt;
        }
        b = &b[..b.len() - 1];
    }
    if b.is_empty() {
        return Val::Int(0);
    }
    let negative = b[b.len() - 1] & 0x80 != 0;
    let mut buf = if negative { [0xff; 8] } else { [0; 8] };
    buf[..b.len()].copy_from_slice(b);
    Val::Int(i64::from_le_bytes(buf))
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
    use super::*;

    fn p(bytes: &[u8]) -> Result<Pickle<'_>, PickleError> {
        parse(bytes, 1_000_000)
    }

    #[test]
    fn protocol_4_dict() {
        // pickle.dumps({"a": [1, -2, 2**40, "x"], "b": (None, True, 1.5)}, protocol=4)
        let bytes = b"\x80\x04\x951\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01J\xfe\xff\xff\xff\x8a\x06\x00\x00\x00\x00\x00\x01\x8c\x01x\x94e\x8c\x01b\x94N\x88G?\xf8\x00\x00\x00\x00\x00\x00\x87\x94u.";
        let pk = p(bytes).unwrap();
        let d = pk.as_dict(pk.root).unwrap();
        assert_eq!(pk.as_str(d[0].0), Some("a"));
        let l = pk.as_list(d[0].1).unwrap();
        assert_eq!(l[..3].iter().map(|&v| pk.as_int(v)).collect::<Vec<_>>(), vec![Some(1), Some(-2), Some(1 << 40)]);
        assert_eq!(pk.as_str(l[3]), Some("x"));
        let t = pk.as_list(d[1].1).unwrap();
        assert_eq!(t, &[Val::None, Val::Bool(true), Val::Float(1.5)]);
    }

    #[test]
    fn protocol_0_text() {
        // pickle.dumps({"k": [1, 2**70, "s\u00e9"]}, protocol=0)
        let bytes = b"(dp0\nVk\np1\n(lp2\nI1\naL1180591620717411303424L\naVs\xe9\np3\nas.";
        let pk = p(bytes).unwrap();
        let d = pk.as_dict(pk.root).unwrap();
        assert_eq!(pk.as_str(d[0].0), Some("k"));
        let l = pk.as_list(d[0].1).unwrap();
        assert_eq!(l[0], Val::Int(1));
        assert_eq!(l[1], Val::BigInt);
        assert_eq!(pk.as_str(l[2]), Some("sé"));
    }

    #[test]
    fn long_ints() {
        assert_eq!(binary_int(&[]), Val::Int(0));
        assert_eq!(binary_int(&[0xff]), Val::Int(-1));
        assert_eq!(binary_int(&[0x00, 0x80]), Val::Int(-32768));
        assert_eq!(binary_int(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 0x00]), Val::Int(i64::MAX));
        assert_eq!(binary_int(&[0, 0, 0, 0, 0, 0, 0, 0x80, 0x00]), Val::BigInt);
        assert_eq!(binary_int(&[0, 0, 0, 0, 0, 0, 0, 0x80, 0xff]), Val::Int(i64::MIN));
        assert_eq!(text_int(b"-12"), Some(Val::Int(-12)));
        assert_eq!(text_int(b"99999999999999999999"), Some(Val::BigInt));
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
        let pk = parse(&b, 10_000).unwrap();
        assert!(pk.nodes.len() < 100);
        let mut v = pk.root;
        for _ in 0..60 {
            let l = pk.as_list(v).unwrap();
            assert_eq!(l.len(), 2);
            v = l[1];
        }
        assert_eq!(pk.as_list(v).unwrap(), &[Val::Int(0)]);
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
        assert_eq!(
            parse(b"]]]]]].", 3).err().unwrap().to_string(),
            "the pickle holds more than 3 values (raise ImportLimits::max_values)"
        );
        // Trailing bytes after STOP are ignored, as in Python.
        assert!(p(b"N.garbage").is_ok());
    }
}
