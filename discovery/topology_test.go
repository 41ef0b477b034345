package discovery

import (
	"os"
	"path/filepath"
	"testing"
)

func TestTopologyGivesEachNodeItsDomain(t *testing.T) {
	dir := t.TempDir()
	conf := filepath.Join(dir, "topology.conf")
	os.WriteFile(conf, []byte("# Slurm's tree topology\nSwitchName=s1 Nodes=gpu[001-002]\n"+
		"SwitchName=s2 Nodes=gpu[003-004] LinkSpeed=100\nSwitchName=top Switches=s[1-2]\n"), 0o644)
	pairs := filepath.Join(dir, "racks")
	os.WriteFile(pairs, []byte("gpu001 rackA\ngpu002 rackA # same rack\n\ngpu003 rackB\n"), 0o644)
	for _, tc := range []struct {
		topology string
		want     map[string]string // node -> domain
	}{
		{"", map[string]string{"gpu001": "", "gpu004": ""}},
		{"@" + conf, map[string]string{"gpu001": "s1", "gpu002": "s1", "gpu003": "s2", "gpu004": "s2"}},
		{"@" + pairs, map[string]string{"gpu001": "rackA", "gpu002": "rackA", "gpu003": "rackB", "gpu004": ""}},
		{`re:^gpu00([12])`, map[string]string{"gpu001": "1", "gpu002": "2", "gpu003": ""}},
		{`re:^gpu`, map[string]string{"gpu001": "gpu"}},
	} {
		members, err := Discover(Spec{Servers: "gpu001,gpu002,gpu003,gpu004", Topology: tc.topology})
		if err != nil {
			t.Fatalf("%s: %v", tc.topology, err)
		}
		got := map[string]string{}
		for _, m := range members {
			got[m.Node] = m.Domain
		}
		for node, want := range tc.want {
			if got[node] != want {
				t.Errorf("topology %q: %s in %q, want %q", tc.topology, node, got[node], want)
			}
		}
	}
	bad := filepath.Join(dir, "bad")
	os.WriteFile(bad, []byte("gpu001 rackA extra\n"), 0o644)
	for _, topology := range []string{"rack", "re:(", "@" + bad, "@" + filepath.Join(dir, "missing")} {
		if _, err := Discover(Spec{Servers: "gpu001", Topology: topology}); err == nil {
			t.Errorf("topology %q: no error", topology)
		}
	}
}
