package deploy

import (
	"encoding/json"
	"testing"
)

// TestSparesManifestMatchesTheJob: the spares' pods run the training Job's
// container — every variable the Job sets, with the same value, except
// the group — plus FTCOMM_SPARE=1 and a group name of their own, so that
// a spare is a replica in every setting but waiting.
func TestSparesManifestMatchesTheJob(t *testing.T) {
	job := manifestContainer(t, "kubernetes/base/training-job/job.yaml")
	spares := manifestContainer(t, "kubernetes/base/training-job/spares.yaml")
	env := func(c container) map[string]string {
		m := map[string]string{}
		for _, e := range c.Env {
			v := e.Value
			if e.ValueFrom != nil {
				b, _ := json.Marshal(e.ValueFrom)
				v = "from:" + string(b)
			}
			m[e.Name] = v
		}
		return m
	}
	je, se := env(job), env(spares)
	for k, v := range je {
		if k == "FTCOMM_GROUP" {
			continue
		}
		if sv, ok := se[k]; !ok || sv != v {
			t.Errorf("spares.yaml sets %s=%q, the training Job %q", k, sv, v)
		}
	}
	if se["FTCOMM_SPARE"] != "1" {
		t.Errorf("spares.yaml: FTCOMM_SPARE=%q, want 1", se["FTCOMM_SPARE"])
	}
	if g := se["FTCOMM_GROUP"]; g == "" || g == je["FTCOMM_GROUP"] {
		t.Errorf("spares.yaml: FTCOMM_GROUP=%q: want a group name of the spares' own", g)
	}
	if se["FTCOMM_NODE"] == "" || je["FTCOMM_NODE"] == "" {
		t.Error("FTCOMM_NODE (the placement hint) must come from the pod's node in both manifests")
	}
}
