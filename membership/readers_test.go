package membership

import (
	"slices"
	"testing"
)

func TestDeadViewVersionsEachChangeAndAnswersOnlyOlderCallers(t *testing.T) {
	var v DeadView
	if got := v.Apply([]string{"b:1", "c:1"}, nil); got != 2 {
		t.Fatalf("two deaths: version %d, want 2", got)
	}
	if got := v.Apply([]string{"b:1"}, []string{"c:1", "d:1"}); got != 3 {
		t.Fatalf("b again (no change), c back, d not dead: version %d, want 3", got)
	}
	if version, dead := v.Since(1); version != 3 || !slices.Equal(dead, []string{"b:1"}) {
		t.Errorf("a caller at version 1 got %d %v, want 3 [b:1]", version, dead)
	}
	if version, dead := v.Since(3); version != 3 || dead != nil {
		t.Errorf("an up-to-date caller got %d %v, want 3 and no list", version, dead)
	}
}

func TestOutboxQueuesTheLatestNewsPerServer(t *testing.T) {
	var o Outbox
	o.Tell("b:1", true)
	o.Tell("c:1", true)
	o.Tell("c:1", false) // back before the news went out: only the latest counts
	version, dead, alive := o.Take()
	if version != 0 || !slices.Equal(dead, []string{"b:1"}) || !slices.Equal(alive, []string{"c:1"}) {
		t.Errorf("took %d %v %v, want 0 [b:1] [c:1]", version, dead, alive)
	}
	if _, dead, alive := o.Take(); dead != nil || alive != nil {
		t.Errorf("a second take got %v %v, want nothing", dead, alive)
	}
	if !o.Heard(2) || o.Heard(2) || o.Heard(1) || !o.Heard(5) {
		t.Error("Heard is true only for a version newer than every one heard")
	}
	if version, _, _ := o.Take(); version != 5 {
		t.Errorf("requests carry version %d, want the last heard, 5", version)
	}
}
