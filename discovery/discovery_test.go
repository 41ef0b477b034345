package discovery

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/fitcache/fitcache/ring"
)

func TestExpandHostlist(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []string
	}{
		{"gpu[001-004,010],login1", []string{"gpu001", "gpu002", "gpu003", "gpu004", "gpu010", "login1"}},
		{"node1", []string{"node1"}},
		{"n[8-11]", []string{"n8", "n9", "n10", "n11"}},
		{"a[1-2],b[07-08]", []string{"a1", "a2", "b07", "b08"}},
		{"rack[1-2]-n[01-02]", []string{"rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"}},
		{"x[3],x3, y", []string{"x3", "y"}},
	} {
		got, err := ExpandHostlist(tc.in)
		if err != nil {
			t.Errorf("ExpandHostlist(%q): %v", tc.in, err)
			continue
		}
		if diff := cmp.Diff(tc.want, got); diff != "" {
			t.Errorf("ExpandHostlist(%q) (-want +got):\n%s", tc.in, diff)
		}
	}
	for _, bad := range []string{"gpu[1-", "gpu]", "gpu[4-1]", "gpu[a-b]", "g[[1]]",
		"n[0-99999]r[0-99999]", "a[0-60000],b[0-60000]"} { // the last two: over maxHosts, in one term or the list
		if _, err := ExpandHostlist(bad); err == nil {
			t.Errorf("ExpandHostlist(%q) succeeded, want an error", bad)
		}
	}
}

func TestDiscover(t *testing.T) {
	hostfile := filepath.Join(t.TempDir(), "hosts")
	os.WriteFile(hostfile, []byte("# the job's nodes\nn1 slots=4\n\nn2:9000\n"), 0o644)
	for _, tc := range []struct {
		spec Spec
		want []ring.Member
	}{
		{Spec{Servers: "10.0.0.1:7070, 10.0.0.2:7071"}, []ring.Member{{ID: "10.0.0.1:7070", Node: "10.0.0.1"}, {ID: "10.0.0.2:7071", Node: "10.0.0.2"}}},
		{Spec{Servers: "@" + hostfile, BasePort: 8000}, []ring.Member{{ID: "n1:8000", Node: "n1"}, {ID: "n2:9000", Node: "n2"}}},
		{Spec{Servers: "slurm", NodeList: "gpu[01-02]", PerNode: 2}, []ring.Member{
			{ID: "gpu01:7070", Node: "gpu01"}, {ID: "gpu01:7071", Node: "gpu01"},
			{ID: "gpu02:7070", Node: "gpu02"}, {ID: "gpu02:7071", Node: "gpu02"}}},
	} {
		got, err := Discover(tc.spec)
		if err != nil {
			t.Errorf("Discover(%+v): %v", tc.spec, err)
			continue
		}
		if diff := cmp.Diff(tc.want, got); diff != "" {
			t.Errorf("Discover(%+v) (-want +got):\n%s", tc.spec, diff)
		}
	}
	t.Setenv("SLURM_JOB_NODELIST", "")
	for _, bad := range []Spec{{}, {Servers: "slurm"}, {Servers: "@/nonexistent"}, {Servers: "h:port"}, {Servers: " , "}} {
		if _, err := Discover(bad); err == nil {
			t.Errorf("Discover(%+v) succeeded, want an error", bad)
		}
	}
}

func TestTokenFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "token")
	tok, err := CreateTokenFile(path)
	if err != nil || len(tok) != 64 {
		t.Fatalf("CreateTokenFile = %q, %v", tok, err)
	}
	if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o600 {
		t.Errorf("token file mode %o, want 0600", fi.Mode().Perm())
	}
	if _, err := CreateTokenFile(path); err == nil {
		t.Error("CreateTokenFile replaced an existing token")
	}
	if got, err := LoadToken("", path); err != nil || got != tok {
		t.Errorf("LoadToken = %q, %v; want %q", got, err, tok)
	}
	if got, _ := LoadToken("explicit", path); got != "explicit" {
		t.Errorf("an explicit token did not take precedence: %q", got)
	}
	os.Chmod(path, 0o644)
	if _, err := LoadToken("", path); err == nil {
		t.Error("a token file readable by others was accepted")
	}
}

// FuzzExpandHostlist: any input gives hosts or an error, never a panic or a blow-up; hosts are
// unique, non-empty and hold no bracket or comma; a list without brackets gives its terms.
func FuzzExpandHostlist(f *testing.F) {
	for _, seed := range []string{"gpu[001-004,010],login1", "rack[1-2]-n[01-02]", "x[3],x3, y", "g[[1]]", "a[0-99999]b[0-99999]", "a[0-60000],b[0-60000]", ""} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, list string) {
		hosts, err := ExpandHostlist(list)
		if err != nil {
			return
		}
		if len(hosts) > maxHosts {
			t.Fatalf("%q expanded to %d hosts, more than %d", list, len(hosts), maxHosts)
		}
		seen := map[string]bool{}
		for _, h := range hosts {
			if h == "" || strings.ContainsAny(h, "[],") || seen[h] {
				t.Fatalf("%q gave a bad or repeated host %q in %q", list, h, hosts)
			}
			seen[h] = true
		}
		if !strings.ContainsAny(list, "[]") {
			var terms []string
			for _, term := range strings.Split(list, ",") {
				if term = strings.TrimSpace(term); term != "" && !slices.Contains(terms, term) {
					terms = append(terms, term)
				}
			}
			if !slices.Equal(terms, hosts) {
				t.Fatalf("%q gave %q, want its terms %q", list, hosts, terms)
			}
		}
	})
}
