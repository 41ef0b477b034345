package core

import (
	"reflect"
	"testing"
)

// StatsSnapshot.Add totals every counter (the job's totals in `fitcache stats` are made with
// it): a counter added to the snapshot and forgotten in Add showed 0 for a cluster.
func TestStatsSnapshotAddTotalsEveryCounter(t *testing.T) {
	var one StatsSnapshot
	v := reflect.ValueOf(&one).Elem()
	for i := range v.NumField() {
		if f := v.Field(i); f.Kind() == reflect.Int64 {
			f.SetInt(1)
		}
	}
	var total StatsSnapshot
	total.Add(one)
	total.Add(one)
	tv := reflect.ValueOf(total)
	for i := range tv.NumField() {
		if f := tv.Field(i); f.Kind() == reflect.Int64 && f.Int() != 2 {
			t.Errorf("%s: %d after adding 1 twice, want 2", tv.Type().Field(i).Name, f.Int())
		}
	}
}
