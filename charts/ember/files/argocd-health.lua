-- Argo CD health check for ember.dev/InferenceDeployment.
--
-- Install: put this whole file under the key
--   resource.customizations.health.ember.dev_InferenceDeployment
-- of the argocd-cm ConfigMap in Argo CD's namespace (argocd-cm-snippet.yaml beside this file
-- shows it), e.g. with the argo-cd Helm chart:
--   configs:
--     cm:
--       resource.customizations.health.ember.dev_InferenceDeployment: |
--         <this file>
-- Argo CD reads the key at once; `argocd app get APP` then shows the object's health.
--
-- Contract (Argo CD, gopher-lua = Lua 5.1): the object is the global `obj`; the script returns
-- {status = Healthy | Progressing | Degraded | Suspended | Missing, message = "..."}.
-- It reads only what the Ember operator writes (status.observedGeneration, the conditions
-- Ready, Progressing, Degraded, Reconciling, Stalled, each with its observedGeneration, and
-- status.rollout.phase), in this order:
--   1. generation not observed yet (no status, or an older status or condition) -> Progressing
--   2. Stalled=True or Degraded=True -> Degraded, with that condition's message; except
--      Degraded=True for ModelDownloading (replicas wait for their model: slow, not broken)
--      -> Progressing, as kstatus says InProgress for it
--   3. status.rollout.phase Paused -> Suspended; Halted or RolledBack -> Degraded
--   4. Reconciling=True, Progressing=True or Ready=False -> Progressing
--   5. Ready=True -> Healthy
-- tests/fleet/test_fleet_health.py runs this file next to kstatus on the operator's own status.

local hs = {}

local function done(status, message)
  hs.status = status
  hs.message = message or ""
  return hs
end

local function text(value)
  if value == nil or value == "" then
    return nil
  end
  return tostring(value)
end

if obj.metadata ~= nil and obj.metadata.deletionTimestamp ~= nil then
  return done("Progressing", "pending deletion")
end

local generation = (obj.metadata or {}).generation or 0
local status = obj.status
if status == nil or status.observedGeneration == nil or status.observedGeneration < generation then
  local seen = status and status.observedGeneration or "none"
  return done("Progressing", "waiting for the operator to observe generation "
    .. tostring(generation) .. " (observed: " .. tostring(seen) .. ")")
end

local conditions = {}
for _, c in ipairs(status.conditions or {}) do
  if c.type ~= nil then
    if c.observedGeneration ~= nil and c.observedGeneration < generation then
      return done("Progressing", "waiting for the operator: condition " .. c.type
        .. " is for generation " .. tostring(c.observedGeneration) .. " of " .. tostring(generation))
    end
    conditions[c.type] = c
  end
end

local function is(ctype, value)
  local c = conditions[ctype]
  return c ~= nil and c.status == value
end

local function say(ctype)
  local c = conditions[ctype]
  return text(c.message) or text(c.reason) or ctype
end

if is("Stalled", "True") then
  return done("Degraded", say("Stalled"))
end
if is("Degraded", "True") then
  if conditions["Degraded"].reason == "ModelDownloading" then
    return done("Progressing", say("Degraded"))
  end
  return done("Degraded", say("Degraded"))
end

local rollout = status.rollout
if rollout ~= nil then
  local detail = text(rollout.message) or text(rollout.summary)
  if rollout.phase == "Paused" then
    return done("Suspended", detail or "rollout paused")
  end
  if rollout.phase == "Halted" or rollout.phase == "RolledBack" then
    return done("Degraded", detail or ("rollout " .. rollout.phase))
  end
end

for _, ctype in ipairs({"Reconciling", "Progressing"}) do
  if is(ctype, "True") then
    return done("Progressing", say(ctype))
  end
end
if is("Ready", "False") then
  return done("Progressing", say("Ready"))
end
if is("Ready", "True") then
  return done("Healthy", say("Ready"))
end
return done("Progressing", "waiting for the operator: no Ready condition yet")
