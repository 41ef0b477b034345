package clayout

import (
	"go/ast"
	"go/parser"
	"go/token"
	"strconv"
	"testing"
	"time"

	"github.com/fitcache/fitcache/core"
)

// The C code's limits (capi/fclimits.h) are the Go side's.
func TestLimitsMatchGo(t *testing.T) {
	if got, want := int64(ReadNowBytes), int64(core.ReadNowBytes); got != want {
		t.Errorf("FC_READ_NOW_BYTES: got %v, want core.ReadNowBytes %v", got, want)
	}
	if got, want := time.Duration(SourceKeepMs)*time.Millisecond, sourceKeep(t); got != want {
		t.Errorf("FC_SOURCE_KEEP_MS: got %v, want client.sourceKeep %v", got, want)
	}
}

// sourceKeep returns client.sourceKeep, which is not exported: read from its declaration in
// client/ranges.go, written as a whole number of time units (5 * time.Second).
func sourceKeep(t *testing.T) time.Duration {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), "../../client/ranges.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	units := map[string]time.Duration{"Millisecond": time.Millisecond, "Second": time.Second, "Minute": time.Minute}
	obj := f.Scope.Lookup("sourceKeep")
	if obj == nil {
		t.Fatal("client/ranges.go declares no sourceKeep")
	}
	spec, ok := obj.Decl.(*ast.ValueSpec)
	if !ok || len(spec.Values) != 1 {
		t.Fatal("sourceKeep is not a constant of one value")
	}
	if e, ok := spec.Values[0].(*ast.BinaryExpr); ok && e.Op == token.MUL {
		n, nok := e.X.(*ast.BasicLit)
		u, uok := e.Y.(*ast.SelectorExpr)
		if nok && uok && n.Kind == token.INT && units[u.Sel.Name] != 0 {
			if pkg, ok := u.X.(*ast.Ident); ok && pkg.Name == "time" {
				k, err := strconv.ParseInt(n.Value, 0, 64)
				if err == nil {
					return time.Duration(k) * units[u.Sel.Name]
				}
			}
		}
	}
	t.Fatalf("sourceKeep is not written as N * time.Unit: teach this test its new form")
	return 0
}
