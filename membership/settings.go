package membership

import (
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// A job's settings are a small document of typed keys and values that an
// operator changes while the job runs (`ftcoord job set`, the coordinator's
// API): a learning rate, DiLoCo's sync period. The coordinator keeps it
// (etcdkeys.Layout.Settings, signed like its quorums), numbers its versions,
// and names the version in force in every quorum (Quorum.Settings); a
// change is published as a new epoch, so every replica of the epoch takes
// it from the same step — the first of the epoch, which its participants
// agree on (ft.Comm.Settings, ft.EventSettings). The document itself
// travels in the quorum view that changes it.

// SettingType is the type of a setting's value. A key keeps its type: a
// value that does not parse as its key's type is refused.
type SettingType string

// The setting types.
const (
	SettingString   SettingType = "string"
	SettingInt      SettingType = "int"   // int64
	SettingFloat    SettingType = "float" // float64, finite
	SettingBool     SettingType = "bool"  // true or false
	SettingDuration SettingType = "duration"
)

// Setting is one value, in canonical form (Value parses as Type and
// prints back the same).
type Setting struct {
	Type  SettingType `json:"type"`
	Value string      `json:"value"`
}

// SettingTargetReplicas is the key of the one setting the coordinator
// itself reads: the job's target size in replica groups, which its spares
// refill it to (int, at least 1; unset: the most replica groups a quorum
// of the run had, Quorum.Target). Keys under "ftcomm." are the
// coordinator's: an unknown one, or a value it cannot use, is refused.
const SettingTargetReplicas = "ftcomm.target_replicas"

// SettingBatchPolicy is the key of the job's global-batch policy, which
// ft's samplers read (ft.SamplerConfig.Policy): "replica" (every rank
// keeps its batch; the global batch follows the participants) or
// "global" (the survivors take more micro-batches to keep it).
const SettingBatchPolicy = "ftcomm.batch_policy"

// SettingPreparedGrow is the key of whether the coordinator marks grows
// prepared (Quorum.Prepared: the survivors form the grown epoch's comms
// in the background and move at an agreed step; ft "Grows"): a bool,
// true when unset. false makes every grow stop the survivors while the
// comms are made, as before prepared grows.
const SettingPreparedGrow = "ftcomm.prepared_grow"

// Limits of a settings document.
const (
	MaxSettings      = 128  // keys
	MaxSettingKey    = 64   // bytes
	MaxSettingValue  = 1024 // bytes
	maxSettingsBytes = 32 << 10
)

var settingKeyRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_.-]{0,63}$`)

// JobSettings is a job's settings document: version Version of its values.
type JobSettings struct {
	Job     string             `json:"job"`
	Version uint64             `json:"version"`
	Values  map[string]Setting `json:"values"`
	Updated time.Time          `json:"updated"`
	By      string             `json:"by,omitempty"` // who set it, for people
	// Signature, when the coordinator signs, covers the document's
	// canonical bytes (context "ftcomm-settings-v1\n").
	Signature *QuorumSignature `json:"signature,omitempty"`
}

// SettingsRef names one version of a job's settings document: its
// version and the digest of its canonical bytes.
type SettingsRef struct {
	Version uint64 `json:"version"`
	Digest  string `json:"digest"`
}

const settingsSigContext = "ftcomm-settings-v1\n"

// CanonicalSettings returns the bytes a settings document's signature and
// digest cover (its JSON without the signature, members sorted), and the
// signature it carries.
func CanonicalSettings(raw []byte) (msg []byte, sig *QuorumSignature, err error) {
	return canonicalRecord(settingsSigContext, raw)
}

// Ref returns the document's version and digest.
func (s JobSettings) Ref() SettingsRef {
	s.Signature = nil
	raw, _ := json.Marshal(s)
	msg, _, _ := CanonicalSettings(raw)
	sum := sha256.Sum256(msg)
	return SettingsRef{Version: s.Version, Digest: hex.EncodeToString(sum[:16])}
}

// VerifySettings decodes a settings document and checks its signature
// (wrapping ErrForgedQuorum when no trusted key signed it).
func (v *QuorumVerifier) VerifySettings(raw []byte) (JobSettings, error) {
	msg, sig, err := CanonicalSettings(raw)
	if err != nil {
		return JobSettings{}, err
	}
	if sig == nil {
		return JobSettings{}, fmt.Errorf("%w: the settings document is not signed", ErrForgedQuorum)
	}
	pub, ok := v.keys[sig.KeyID]
	if !ok || !ed25519.Verify(pub, msg, sig.Ed25519) {
		return JobSettings{}, fmt.Errorf("%w: the settings document's signature (key %q) does not verify", ErrForgedQuorum, sig.KeyID)
	}
	var s JobSettings
	if err := json.Unmarshal(raw, &s); err != nil {
		return JobSettings{}, fmt.Errorf("membership: settings document: %w", err)
	}
	return s, nil
}

// Keys returns the document's keys, sorted.
func (s JobSettings) Keys() []string {
	ks := make([]string, 0, len(s.Values))
	for k := range s.Values {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

// String returns key's value as written (any type); ok false when unset.
func (s JobSettings) String(key string) (string, bool) {
	v, ok := s.Values[key]
	return v.Value, ok
}

// Int returns an int setting; ok false when unset or of another type.
func (s JobSettings) Int(key string) (int64, bool) {
	v, ok := s.Values[key]
	if !ok || v.Type != SettingInt {
		return 0, false
	}
	n, err := strconv.ParseInt(v.Value, 10, 64)
	return n, err == nil
}

// Float returns a float setting (an int one too); ok false when unset or
// of another type.
func (s JobSettings) Float(key string) (float64, bool) {
	v, ok := s.Values[key]
	if !ok || v.Type != SettingFloat && v.Type != SettingInt {
		return 0, false
	}
	f, err := strconv.ParseFloat(v.Value, 64)
	return f, err == nil
}

// Bool returns a bool setting; ok false when unset or of another type.
func (s JobSettings) Bool(key string) (bool, bool) {
	v, ok := s.Values[key]
	if !ok || v.Type != SettingBool {
		return false, false
	}
	return v.Value == "true", true
}

// Duration returns a duration setting; ok false when unset or of another
// type.
func (s JobSettings) Duration(key string) (time.Duration, bool) {
	v, ok := s.Values[key]
	if !ok || v.Type != SettingDuration {
		return 0, false
	}
	d, err := time.ParseDuration(v.Value)
	return d, err == nil
}

// Summary is "k=v k2=v2 …", sorted, for logs and tools.
func (s JobSettings) Summary() string {
	var b strings.Builder
	for i, k := range s.Keys() {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(k + "=" + s.Values[k].Value)
	}
	return b.String()
}

// SettingChange is one change of a settings document: set Key to Value
// (of Type: empty keeps the key's type, or infers a new key's), or unset
// it.
type SettingChange struct {
	Key   string
	Type  SettingType
	Value string
	Unset bool
}

// ParseSettingChange parses "key=value", "key:type=value" or "-key"
// (unset).
func ParseSettingChange(arg string) (SettingChange, error) {
	if k, ok := strings.CutPrefix(arg, "-"); ok {
		if !settingKeyRE.MatchString(k) {
			return SettingChange{}, settingErr("unset %q: not a setting key (want 1–64 of [A-Za-z0-9_.-], starting with a letter or _)", k)
		}
		return SettingChange{Key: k, Unset: true}, nil
	}
	lhs, v, ok := strings.Cut(arg, "=")
	if !ok {
		return SettingChange{}, settingErr("%q: want key=value, key:type=value or -key", arg)
	}
	k, t, typed := strings.Cut(lhs, ":")
	if !settingKeyRE.MatchString(k) {
		return SettingChange{}, settingErr("%q: %q is not a setting key (want 1–64 of [A-Za-z0-9_.-], starting with a letter or _)", arg, k)
	}
	c := SettingChange{Key: k, Value: v}
	if typed {
		c.Type = SettingType(t)
		if !validType(c.Type) {
			return SettingChange{}, settingErr("%q: unknown type %q (want string, int, float, bool or duration)", arg, t)
		}
	}
	return c, nil
}

func validType(t SettingType) bool {
	switch t {
	case SettingString, SettingInt, SettingFloat, SettingBool, SettingDuration:
		return true
	}
	return false
}

func settingErr(format string, args ...any) error {
	return fmt.Errorf("%w: settings: "+format, append([]any{comm.ErrInvalidArgument}, args...)...)
}

// canonicalValue parses v as t and returns its canonical form.
func canonicalValue(t SettingType, v string) (string, error) {
	switch t {
	case SettingString:
		return v, nil
	case SettingInt:
		n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		if err != nil {
			return "", fmt.Errorf("%q is not an integer", v)
		}
		return strconv.FormatInt(n, 10), nil
	case SettingFloat:
		f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if err != nil || math.IsInf(f, 0) || math.IsNaN(f) {
			return "", fmt.Errorf("%q is not a finite number", v)
		}
		return strconv.FormatFloat(f, 'g', -1, 64), nil
	case SettingBool:
		b, err := strconv.ParseBool(strings.TrimSpace(v))
		if err != nil {
			return "", fmt.Errorf("%q is not true or false", v)
		}
		return strconv.FormatBool(b), nil
	case SettingDuration:
		d, err := time.ParseDuration(strings.TrimSpace(v))
		if err != nil {
			return "", fmt.Errorf("%q is not a duration (e.g. 1.5s, 200ms)", v)
		}
		return d.String(), nil
	}
	return "", fmt.Errorf("unknown type %q", t)
}

// inferType is the type a new key set without one takes: bool, int,
// float, duration (a number with a unit), else string.
func inferType(v string) SettingType {
	v = strings.TrimSpace(v)
	if v == "true" || v == "false" {
		return SettingBool
	}
	if _, err := strconv.ParseInt(v, 10, 64); err == nil {
		return SettingInt
	}
	if f, err := strconv.ParseFloat(v, 64); err == nil && !math.IsInf(f, 0) && !math.IsNaN(f) {
		return SettingFloat
	}
	if _, err := time.ParseDuration(v); err == nil && strings.ContainsAny(v, "nuµmsh") {
		return SettingDuration
	}
	return SettingString
}

// Apply returns the next version of the document with the changes made,
// all of them or none: the first change that is malformed (a value that
// does not parse as its key's type, an unknown key to unset, a document
// over its limits) fails the whole.
func (s JobSettings) Apply(changes []SettingChange) (JobSettings, error) {
	if len(changes) == 0 {
		return JobSettings{}, settingErr("no change")
	}
	next := s
	next.Values = make(map[string]Setting, len(s.Values)+len(changes))
	for k, v := range s.Values {
		next.Values[k] = v
	}
	next.Version, next.Signature = s.Version+1, nil
	for _, c := range changes {
		if !settingKeyRE.MatchString(c.Key) {
			return JobSettings{}, settingErr("%q is not a setting key (want 1–64 of [A-Za-z0-9_.-], starting with a letter or _)", c.Key)
		}
		if c.Unset {
			if _, ok := next.Values[c.Key]; !ok {
				return JobSettings{}, settingErr("unset %s: no such setting (the job has: %s)", c.Key, strings.Join(s.Keys(), ", "))
			}
			delete(next.Values, c.Key)
			continue
		}
		if len(c.Value) > MaxSettingValue {
			return JobSettings{}, settingErr("%s: a value of %d bytes is over the limit of %d", c.Key, len(c.Value), MaxSettingValue)
		}
		t := c.Type
		cur, exists := next.Values[c.Key]
		switch {
		case t != "" && !validType(t):
			return JobSettings{}, settingErr("%s: unknown type %q (want string, int, float, bool or duration)", c.Key, t)
		case t == "" && exists:
			t = cur.Type
		case t == "":
			t = inferType(c.Value)
		}
		v, err := canonicalValue(t, c.Value)
		if err != nil {
			if exists && c.Type == "" {
				return JobSettings{}, settingErr("%s is a setting of type %s (%s=%s): %v; give key:type=value to change its type",
					c.Key, t, c.Key, cur.Value, err)
			}
			return JobSettings{}, settingErr("%s (%s): %v", c.Key, t, err)
		}
		if err := checkReserved(c.Key, t, v); err != nil {
			return JobSettings{}, err
		}
		next.Values[c.Key] = Setting{Type: t, Value: v}
	}
	if len(next.Values) > MaxSettings {
		return JobSettings{}, settingErr("%d settings: at most %d", len(next.Values), MaxSettings)
	}
	if raw, _ := json.Marshal(next); len(raw) > maxSettingsBytes {
		return JobSettings{}, settingErr("the document would take %d bytes: at most %d", len(raw), maxSettingsBytes)
	}
	return next, nil
}

// ParseSettingChanges parses each argument with ParseSettingChange.
func ParseSettingChanges(args []string) ([]SettingChange, error) {
	out := make([]SettingChange, 0, len(args))
	for _, a := range args {
		c, err := ParseSettingChange(a)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, nil
}

// checkReserved refuses what the coordinator could not use under its own
// keys ("ftcomm."): an unknown key, a value of another type or range.
func checkReserved(key string, t SettingType, v string) error {
	if !strings.HasPrefix(key, "ftcomm.") {
		return nil
	}
	switch key {
	case SettingTargetReplicas:
		n, err := strconv.ParseInt(v, 10, 64)
		if t != SettingInt || err != nil || n < 1 || n > math.MaxInt32 {
			return settingErr("%s: want an int of at least 1 (replica groups), got %s %q", key, t, v)
		}
		return nil
	case SettingBatchPolicy:
		if t != SettingString || (v != "replica" && v != "global") {
			return settingErr("%s: want the string replica or global, got %s %q", key, t, v)
		}
		return nil
	case SettingPreparedGrow:
		if t != SettingBool {
			return settingErr("%s: want a bool, got %s %q", key, t, v)
		}
		return nil
	}
	return settingErr("%q: keys under \"ftcomm.\" are the coordinator's, and it knows %s, %s and %s only", key,
		SettingTargetReplicas, SettingBatchPolicy, SettingPreparedGrow)
}
