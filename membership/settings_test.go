package membership

import (
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

func mustChanges(t *testing.T, args ...string) []SettingChange {
	t.Helper()
	cs, err := ParseSettingChanges(args)
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

// A change is all or nothing: types are inferred for new keys and kept
// for known ones; a value that does not parse as its key's type, an
// unknown key to unset or a malformed key fails the whole, saying why.
func TestSettingsApply(t *testing.T) {
	s0 := JobSettings{Job: "j"}
	s1, err := s0.Apply(mustChanges(t, "lr=0.1", "sync_every=50", "warmup=1.5s", "nesterov=true", "name=run a", "beta:float=1"))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]Setting{"lr": {SettingFloat, "0.1"}, "sync_every": {SettingInt, "50"}, "warmup": {SettingDuration, "1.5s"},
		"nesterov": {SettingBool, "true"}, "name": {SettingString, "run a"}, "beta": {SettingFloat, "1"}}
	for k, v := range want {
		if s1.Values[k] != v {
			t.Errorf("%s = %+v, want %+v", k, s1.Values[k], v)
		}
	}
	if s1.Version != 1 || len(s0.Values) != 0 {
		t.Fatalf("version %d; the old document changed: %+v", s1.Version, s0.Values)
	}
	if f, ok := s1.Float("sync_every"); !ok || f != 50 {
		t.Errorf("an int read as a float: %v %v", f, ok)
	}
	if _, ok := s1.Int("lr"); ok {
		t.Error("a float read as an int")
	}
	for _, c := range []struct {
		args []string
		says string
	}{
		{[]string{"lr=0.2", "sync_every=x"}, "sync_every is a setting of type int"},
		{[]string{"lr=1e999"}, "not a finite number"},
		{[]string{"-nosuch"}, "no such setting"},
		{[]string{"nesterov=maybe"}, "not true or false"},
		{[]string{"x:complex=1"}, "unknown type"},
		{[]string{"ftcomm.batch_policy=half"}, "want the string replica or global"},
		{[]string{"ftcomm.batch_policy:int=1"}, "want the string replica or global"},
		{[]string{"ftcomm.target_replicas=0"}, "want an int of at least 1"},
		{[]string{"ftcomm.nosuch=1"}, "it knows ftcomm.target_replicas, ftcomm.batch_policy and ftcomm.prepared_grow only"},
		{[]string{"ftcomm.prepared_grow=2"}, "want a bool"},
	} {
		cs, err := ParseSettingChanges(c.args)
		if err == nil {
			_, err = s1.Apply(cs)
		}
		if !errors.Is(err, comm.ErrInvalidArgument) || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%v: %v, want an invalid argument saying %q", c.args, err, c.says)
		}
	}
	if s, err := s1.Apply(mustChanges(t, "ftcomm.batch_policy=global")); err != nil || s.Values[SettingBatchPolicy] != (Setting{SettingString, "global"}) {
		t.Errorf("the batch policy: %+v %v", s.Values, err)
	}
	if s, err := s1.Apply(mustChanges(t, "ftcomm.prepared_grow=false")); err != nil {
		t.Errorf("prepared grows off: %v", err)
	} else if on, ok := s.Bool(SettingPreparedGrow); !ok || on {
		t.Errorf("prepared grows off: %+v", s.Values)
	}
	s2, err := s1.Apply(mustChanges(t, "-name", "sync_every:float=2.5"))
	if err != nil || s2.Values["sync_every"] != (Setting{SettingFloat, "2.5"}) || len(s2.Values) != 5 {
		t.Fatalf("%+v %v", s2.Values, err)
	}
}

// A document's reference (version and digest) survives its JSON, and a
// signature over it verifies; an altered one does not.
func TestSettingsRefAndSignature(t *testing.T) {
	s, err := JobSettings{Job: "j"}.Apply(mustChanges(t, "lr=0.1"))
	if err != nil {
		t.Fatal(err)
	}
	s.Updated = time.Date(2026, 11, 28, 1, 2, 3, 456, time.UTC)
	pub, priv, _ := ed25519.GenerateKey(nil)
	raw, _ := json.Marshal(s)
	msg, _, err := CanonicalSettings(raw)
	if err != nil {
		t.Fatal(err)
	}
	s.Signature = &QuorumSignature{KeyID: quorumKeyID(pub), Ed25519: ed25519.Sign(priv, msg)}
	raw, _ = json.Marshal(s)
	v := NewQuorumVerifier(NewQuorumKey(pub))
	got, err := v.VerifySettings(raw)
	if err != nil || got.Ref() != s.Ref() {
		t.Fatalf("verify: %v; ref %+v, want %+v", err, got.Ref(), s.Ref())
	}
	forged := strings.Replace(string(raw), `"0.1"`, `"9"`, 1)
	if _, err := v.VerifySettings([]byte(forged)); !errors.Is(err, ErrForgedQuorum) {
		t.Fatalf("an altered document verified: %v", err)
	}
}

// The view that changes the settings carries the document, and so does
// every whole list; a view that keeps them carries only their reference.
func TestViewCarriesSettings(t *testing.T) {
	s, _ := JobSettings{Job: "j"}.Apply(mustChanges(t, "lr=0.1"))
	ref := s.Ref()
	q1 := Quorum{Job: "j", Epoch: 1, Participants: []Participant{{ID: "a", Incarnation: 1}}}
	q2 := q1
	q2.Epoch, q2.Settings = 2, &ref
	q3 := q2
	q3.Epoch = 3
	for _, c := range []struct {
		prev    *Quorum
		q       Quorum
		withDoc bool
	}{{&q1, q2, true}, {&q2, q3, false}, {nil, q3, true}} {
		raw, err := EncodeQuorumViewWith(c.prev, c.q, nil, &s, nil)
		if err != nil {
			t.Fatal(err)
		}
		h, _, err := decodeView(raw, nil)
		if err != nil {
			t.Fatal(err)
		}
		if (h.SettingsDoc != nil) != c.withDoc || h.Settings == nil || *h.Settings != ref {
			t.Errorf("epoch %d: doc %v ref %+v, want doc %v", c.q.Epoch, h.SettingsDoc != nil, h.Settings, c.withDoc)
		}
		if h.SettingsDoc != nil && h.SettingsDoc.Ref() != ref {
			t.Errorf("epoch %d: the carried document's ref %+v, want %+v", c.q.Epoch, h.SettingsDoc.Ref(), ref)
		}
	}
}
