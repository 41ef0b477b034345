package rpc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"sync"

	"github.com/cloudwego/gopkg/protocol/thrift"

	"github.com/fitcache/fitcache/rpc/kitex_gen/fitcachepb/fitcache"
)

// Kitex's generated decoders allocate whatever a container claims before they read its
// elements (make([]string, 0, n) for a list of n strings), so a frame of a few bytes with a
// list of 2^31-1 strings made the decoding process die of an out-of-memory error that no
// recover catches. Neither Kitex v0.16 nor cloudwego/gopkg bound this (gopkg's skip decoder
// walks a frame, but checks containers against the element type the frame declares, not the
// one the decoder expects, and nothing bounds what the decoder then allocates), so every
// frame is checked here before the generated code sees it (see framedCodec): checkFrame
// walks the Thrift binary message within the bytes of its frame, and refuses it unless
//
//   - every string, binary and container fits in the bytes left: a container's element count
//     times the smallest wire size of its element type (a struct is at least its STOP byte);
//   - a field the decoder reads (a known field id with its expected wire type) holds, if a
//     container, elements of the type the decoder expects, which it reads whatever the frame
//     says;
//   - no container holds more than maxContainerElems elements, nesting is at most
//     maxFrameDepth deep, and what the decoders allocate for containers (the elements' Go
//     size times their count, summed over the message) stays within allocBudget of the
//     frame's size: a list of empty structs is 1 byte per element on the wire and tens of
//     bytes in memory.
//
// The expected types come from the generated structs themselves (their thrift and frugal
// tags), so a change of the IDL is checked as soon as the code is generated again.
const (
	maxFrameDepth     = 16
	maxContainerElems = 1 << 20
	maxMethodName     = 128
)

// allocBudget is what the decoders may allocate for the containers of a message of n bytes.
func allocBudget(n int) int { return 4*n + 1<<20 }

// errBadFrame reports a frame that checkFrame refused.
var errBadFrame = errors.New("fitcache: malformed frame")

// wireType is what a decoder expects of a value.
type wireType struct {
	tt     thrift.TType
	key    *wireType           // a map's keys
	elem   *wireType           // a list's, set's or map's elements (values)
	fields map[int16]*wireType // a struct's fields, by id
	closed bool                // a struct whose decoder cannot skip other fields: they are refused
	goSize int                 // bytes a decoder allocates per element of a container of this type
}

// minWireSize is the fewest bytes a value of type tt takes in the binary protocol; 0 for a
// type that is none of Thrift's.
func minWireSize(tt thrift.TType) int {
	switch tt {
	case thrift.BOOL, thrift.BYTE, thrift.STRUCT:
		return 1
	case thrift.I16:
		return 2
	case thrift.I32, thrift.STRING:
		return 4
	case thrift.I64, thrift.DOUBLE:
		return 8
	case thrift.LIST, thrift.SET:
		return 5
	case thrift.MAP:
		return 6
	}
	return 0
}

// fixedSize reports whether every value of type tt has the same size on the wire.
func fixedSize(tt thrift.TType) bool {
	switch tt {
	case thrift.BOOL, thrift.BYTE, thrift.I16, thrift.I32, thrift.I64, thrift.DOUBLE:
		return true
	}
	return false
}

// methodTypes are the expected types of a method's arguments and result.
type methodTypes struct{ args, result *wireType }

var (
	schemaOnce sync.Once
	methods    map[string]methodTypes
	// exceptionType is TApplicationException's: message and type. Its decoder in gopkg v0.2.0
	// skips another field from the start of the struct instead of from the field (and panics
	// on the offsets it gets), so other fields are refused.
	exceptionType = &wireType{tt: thrift.STRUCT, closed: true, fields: map[int16]*wireType{
		1: {tt: thrift.STRING, goSize: 16}, 2: {tt: thrift.I32, goSize: 4}}}
)

// schema returns the expected types of the service's methods, built once from the
// generated code.
func schema() map[string]methodTypes {
	schemaOnce.Do(func() {
		methods = map[string]methodTypes{}
		seen := map[reflect.Type]*wireType{}
		for name, m := range fitcache.NewServiceInfo().Methods {
			methods[name] = methodTypes{
				args:   typeOf(reflect.TypeOf(m.NewArgs()), "", seen),
				result: typeOf(reflect.TypeOf(m.NewResult()), "", seen),
			}
		}
	})
	return methods
}

// scalarTypes are the wire types of the generated code's scalar Go types.
var scalarTypes = map[reflect.Kind]thrift.TType{reflect.Bool: thrift.BOOL, reflect.Int8: thrift.BYTE,
	reflect.Int16: thrift.I16, reflect.Int32: thrift.I32, reflect.Int64: thrift.I64, reflect.Float64: thrift.DOUBLE,
	reflect.String: thrift.STRING}

// typeOf returns the wire type of a generated Go type; idl is the type as the field's frugal
// tag names it ("list<string>", "Reason", ...), "" when unknown.
func typeOf(t reflect.Type, idl string, seen map[reflect.Type]*wireType) *wireType {
	if w, ok := seen[t]; ok {
		return w
	}
	if tt, ok := scalarTypes[t.Kind()]; ok {
		if tt == thrift.I64 && idl != "i64" && t.PkgPath() != "" { // an enum: i32 on the wire
			tt = thrift.I32
		}
		return &wireType{tt: tt, goSize: int(t.Size())}
	}
	switch t.Kind() {
	case reflect.Pointer:
		if t.Elem().Kind() == reflect.Struct {
			w := &wireType{tt: thrift.STRUCT, fields: map[int16]*wireType{}}
			// A generated list of structs allocates the pointers and the structs.
			w.goSize = int(t.Size() + t.Elem().Size())
			seen[t] = w
			st := t.Elem()
			for i := 0; i < st.NumField(); i++ {
				f := st.Field(i)
				tag, ok := f.Tag.Lookup("thrift")
				if !ok {
					continue
				}
				parts := strings.Split(tag, ",")
				if len(parts) < 2 {
					continue
				}
				id, err := strconv.ParseInt(parts[1], 10, 16)
				if err != nil {
					continue
				}
				fidl := ""
				if fp := strings.SplitN(f.Tag.Get("frugal"), ",", 3); len(fp) == 3 {
					fidl = fp[2]
				}
				w.fields[int16(id)] = typeOf(f.Type, fidl, seen)
			}
			return w
		}
		if _, ok := scalarTypes[t.Elem().Kind()]; ok { // an optional scalar: allocated when set
			w := *typeOf(t.Elem(), idl, seen)
			w.goSize += int(t.Size())
			return &w
		}
	case reflect.Slice:
		if t.Elem().Kind() == reflect.Uint8 {
			return &wireType{tt: thrift.STRING, goSize: 24} // binary
		}
		tt := thrift.LIST
		if strings.HasPrefix(idl, "set<") {
			tt = thrift.SET
		}
		return &wireType{tt: tt, elem: typeOf(t.Elem(), containerElem(idl, 1), seen), goSize: 24}
	case reflect.Map:
		k, v := typeOf(t.Key(), containerElem(idl, 0), seen), typeOf(t.Elem(), containerElem(idl, 1), seen)
		return &wireType{tt: thrift.MAP, key: k, elem: v, goSize: 8} // its entries: see elements
	}
	panic(fmt.Sprintf("rpc: no wire type for generated Go type %v", t))
}

// containerElem returns the IDL name of a container's key (part 0) or element or value
// (part 1): "string" for part 1 of "list<string>", "i64" for part 1 of "map<string:i64>".
func containerElem(idl string, part int) string {
	open, end := strings.IndexByte(idl, '<'), strings.LastIndexByte(idl, '>')
	if open < 0 || end < open {
		return ""
	}
	inner := idl[open+1 : end]
	if !strings.HasPrefix(idl, "map<") {
		return inner
	}
	depth := 0
	for i, c := range inner {
		switch c {
		case '<':
			depth++
		case '>':
			depth--
		case ':':
			if depth == 0 {
				return [2]string{inner[:i], inner[i+1:]}[part]
			}
		}
	}
	return ""
}

// frameCheck walks one message.
type frameCheck struct {
	b      []byte
	off    int
	budget int // bytes the decoders may still allocate for containers
}

// checkFrame checks a Thrift binary message (strict, as Kitex sends it) that fills b, a
// frame's payload, against the service's types (see above).
func checkFrame(b []byte) error {
	c := &frameCheck{b: b, budget: allocBudget(len(b))}
	if err := c.message(); err != nil {
		return fmt.Errorf("%w: %w", errBadFrame, err)
	}
	return nil
}

func (c *frameCheck) take(n int) ([]byte, error) {
	if n < 0 || n > len(c.b)-c.off {
		return nil, fmt.Errorf("%d bytes wanted at offset %d of %d", n, c.off, len(c.b))
	}
	p := c.b[c.off : c.off+n]
	c.off += n
	return p, nil
}

func (c *frameCheck) u32() (uint32, error) {
	p, err := c.take(4)
	if err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint32(p), nil
}

func (c *frameCheck) message() error {
	v, err := c.u32()
	if err != nil {
		return err
	}
	if v&0xffff0000 != 0x80010000 { // version 1, strict
		return fmt.Errorf("not a strict binary message (%#x)", v)
	}
	n, err := c.u32()
	if err != nil {
		return err
	}
	if n == 0 || n > maxMethodName {
		return fmt.Errorf("method name of %d bytes", n)
	}
	name, err := c.take(int(n))
	if err != nil {
		return err
	}
	if _, err := c.take(4); err != nil { // sequence id
		return err
	}
	var want *wireType // nil: an unknown method, which Kitex refuses; walked all the same
	switch mt := thrift.TMessageType(v & 0xff); mt {
	case thrift.CALL, thrift.ONEWAY:
		want = schema()[string(name)].args
	case thrift.REPLY:
		want = schema()[string(name)].result
	case thrift.EXCEPTION:
		want = exceptionType
	default:
		return fmt.Errorf("message type %d", mt)
	}
	if err := c.value(thrift.STRUCT, want, 0); err != nil {
		return err
	}
	if c.off != len(c.b) {
		return fmt.Errorf("%d bytes after the message", len(c.b)-c.off)
	}
	return nil
}

// value walks a value of wire type tt, which the decoder reads as want (nil: skips it).
func (c *frameCheck) value(tt thrift.TType, want *wireType, depth int) error {
	if depth > maxFrameDepth {
		return fmt.Errorf("nested deeper than %d", maxFrameDepth)
	}
	switch tt {
	case thrift.STRING:
		n, err := c.u32()
		if err != nil {
			return err
		}
		_, err = c.take(int(int32(n)))
		return err
	case thrift.STRUCT:
		for {
			h, err := c.take(1)
			if err != nil {
				return err
			}
			ft := thrift.TType(h[0])
			if ft == thrift.STOP {
				return nil
			}
			idb, err := c.take(2)
			if err != nil {
				return err
			}
			var fw *wireType
			if want != nil {
				id := int16(binary.BigEndian.Uint16(idb))
				if f := want.fields[id]; f != nil && f.tt == ft {
					fw = f // the decoder reads it; otherwise it skips it
				} else if want.closed {
					return fmt.Errorf("field %d of type %d where none is expected", id, ft)
				}
			}
			if err := c.value(ft, fw, depth+1); err != nil {
				return err
			}
		}
	case thrift.LIST, thrift.SET:
		h, err := c.take(5)
		if err != nil {
			return err
		}
		et, n := thrift.TType(h[0]), int(int32(binary.BigEndian.Uint32(h[1:])))
		var ew *wireType
		if want != nil {
			ew = want.elem
		}
		return c.elements(n, et, 0, nil, ew, depth)
	case thrift.MAP:
		h, err := c.take(6)
		if err != nil {
			return err
		}
		kt, vt, n := thrift.TType(h[0]), thrift.TType(h[1]), int(int32(binary.BigEndian.Uint32(h[2:])))
		var kw, vw *wireType
		if want != nil {
			kw, vw = want.key, want.elem
		}
		return c.elements(n, vt, kt, kw, vw, depth)
	}
	if size := minWireSize(tt); size > 0 { // fixed-size scalars
		_, err := c.take(size)
		return err
	}
	return fmt.Errorf("unknown type %d", tt)
}

// elements walks n elements of a list or set (keyType 0) or n entries of a map, checking
// the count against the bytes left and, for a container the decoder reads (elemWant set),
// the declared types against the expected ones and the decoder's allocation against the
// budget.
func (c *frameCheck) elements(n int, elemType, keyType thrift.TType, keyWant, elemWant *wireType, depth int) error {
	if n < 0 || n > maxContainerElems {
		return fmt.Errorf("container of %d elements", n)
	}
	size := minWireSize(elemType)
	if keyType != 0 {
		ks := minWireSize(keyType)
		if ks == 0 {
			size = 0
		}
		size += ks
	}
	if size == 0 || (keyType != 0 && minWireSize(elemType) == 0) {
		return fmt.Errorf("container of unknown type %d/%d", keyType, elemType)
	}
	if n > (len(c.b)-c.off)/size {
		return fmt.Errorf("container of %d elements of at least %d bytes in %d bytes", n, size, len(c.b)-c.off)
	}
	if elemWant != nil {
		if elemWant.tt != elemType || (keyWant != nil && keyWant.tt != keyType) {
			return fmt.Errorf("container of %d/%d where %v/%v are expected", keyType, elemType, keyWant, elemWant)
		}
		cost := elemWant.goSize
		if keyWant != nil { // a Go map costs about twice its keys and values
			cost = 2 * (keyWant.goSize + elemWant.goSize)
		}
		if c.budget -= n * cost; c.budget < 0 {
			return fmt.Errorf("containers that would take more than %d bytes to decode from a frame of %d", allocBudget(len(c.b)), len(c.b))
		}
	}
	if fixedSize(elemType) && (keyType == 0 || fixedSize(keyType)) {
		_, err := c.take(n * size)
		return err
	}
	for i := 0; i < n; i++ {
		if keyType != 0 {
			if err := c.value(keyType, keyWant, depth+1); err != nil {
				return err
			}
		}
		if err := c.value(elemType, elemWant, depth+1); err != nil {
			return err
		}
	}
	return nil
}

// String describes a wire type in errors.
func (w *wireType) String() string {
	if w == nil {
		return "any"
	}
	return strconv.Itoa(int(w.tt))
}
