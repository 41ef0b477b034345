package discovery

import (
	"bufio"
	"fmt"
	"regexp"
	"strings"
)

// Failure domains (Spec.Topology): the switch or rack of each node, so that replicas go to
// distinct ones (see ring.Member.Domain). Three ways to give them:
//
//	re:REGEX   a pattern of the host names: a node's domain is the pattern's first group
//	           (or its whole match) in the node's name; a node it does not match has none
//	           (re:^(rack[0-9]+)- puts rack3-gpu01 in rack3)
//	@PATH      a file: Slurm's topology.conf (its leaf switches, "SwitchName=s1
//	           Nodes=gpu[001-016]"), or lines "HOST DOMAIN" ('#' comments); a regular
//	           file of at most maxFileBytes, naming at most maxHosts hosts in all
//
// A node the topology does not name has no domain: it is only kept apart from other nodes.

// domains returns the failure domain of each node that topology names.
func domains(topology string) (func(node string) string, error) {
	switch {
	case topology == "":
		return func(string) string { return "" }, nil
	case strings.HasPrefix(topology, "re:"):
		re, err := regexp.Compile(topology[3:])
		if err != nil {
			return nil, fmt.Errorf("topology %q: %w", topology, err)
		}
		return func(node string) string {
			m := re.FindStringSubmatch(node)
			switch {
			case m == nil:
				return ""
			case len(m) > 1:
				return m[1]
			}
			return m[0]
		}, nil
	case strings.HasPrefix(topology, "@"):
		byNode, err := readTopology(topology[1:])
		if err != nil {
			return nil, err
		}
		return func(node string) string { return byNode[node] }, nil
	}
	return nil, fmt.Errorf("topology %q: want re:REGEX or @FILE", topology)
}

// readTopology reads a topology file (see domains). Every client process reads it at start,
// so it is bounded (see openListFile) and so is what it names: maxHosts hosts in all, its
// lines and hostlists together (40 lines of 100,000 hosts each cost each client 647 MB and
// 6.4 s).
func readTopology(path string) (map[string]string, error) {
	f, err := openListFile("topology file", path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	byNode := map[string]string{}
	named := 0 // hosts the lines named so far, duplicates included
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		fields := strings.Fields(line)
		if len(fields) == 0 {
			continue
		}
		if !strings.Contains(line, "=") { // HOST DOMAIN
			if len(fields) != 2 {
				return nil, fmt.Errorf("topology %s:%d: want HOST DOMAIN, got %q", path, n, strings.TrimSpace(line))
			}
			if named++; named > maxHosts {
				return nil, fmt.Errorf("topology %s:%d: more than %d hosts in the file", path, n, maxHosts)
			}
			byNode[fields[0]] = fields[1]
			continue
		}
		switchName, nodes := "", ""
		for _, kv := range fields { // topology.conf: SwitchName=s1 Nodes=gpu[001-004] (or Switches=...)
			k, v, _ := strings.Cut(kv, "=")
			switch strings.ToLower(k) {
			case "switchname":
				switchName = v
			case "nodes":
				nodes = v
			}
		}
		if switchName == "" || nodes == "" {
			continue // a switch of switches, or a line of another kind
		}
		if named >= maxHosts {
			return nil, fmt.Errorf("topology %s:%d: more than %d hosts in the file", path, n, maxHosts)
		}
		hosts, err := expandHostlist(nodes, maxHosts-named)
		if err != nil {
			return nil, fmt.Errorf("topology %s:%d: %w (at most %d hosts in the file)", path, n, err, maxHosts)
		}
		named += len(hosts)
		for _, h := range hosts {
			byNode[h] = switchName
		}
	}
	return byNode, sc.Err()
}
