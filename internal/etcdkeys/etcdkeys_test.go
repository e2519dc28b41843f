package etcdkeys

import "testing"

// Every key of a job, the members' and the coordinators', parses back to
// its job and kind; keys outside the root or of no job do not.
func TestParse(t *testing.T) {
	k := Layout{Root: "/r/"}
	for _, c := range []struct {
		key, job, kind, rest string
	}{
		{k.Member("j", "a.0"), "j", "members", "a.0"},
		{k.Revocation("j", 7), "j", "epoch", "revoked/00000000000000000007"},
		{k.Run("j"), "j", "run", ""},
		{k.GroupLease("j", "g"), "j", "groups", "g"},
		{k.GroupJoined("j", "g"), "j", "groupjoined", "g"},
		{k.Quorum("j"), "j", "_quorum", ""},
		{k.QuorumView("j"), "j", "_view", ""},
		{k.HistoryEntry("j", 3), "j", "_history", "00000000000000000003"},
		{k.Evicted("j", "b"), "j", "_evicted", "b"},
	} {
		job, kind, rest, ok := k.Parse(c.key)
		if !ok || job != c.job || kind != c.kind || rest != c.rest {
			t.Errorf("Parse(%q) = %q %q %q %v; want %q %q %q", c.key, job, kind, rest, ok, c.job, c.kind, c.rest)
		}
	}
	for _, key := range []string{"/other/j/members/a", k.Election() + "/x", k.CoordinatorGossip() + "c0", "/r/j"} {
		if job, kind, _, ok := k.Parse(key); ok {
			t.Errorf("Parse(%q) = %q %q, want not a job's key", key, job, kind)
		}
	}
	if got := (Layout{}).Prefix(); got != DefaultRoot+"/" {
		t.Errorf("default prefix %q", got)
	}
}
