-- Argo CD health of a serving.ketch.dev/InferenceService, from the status the Ketch operator
-- writes (docs/operator.md#status-and-what-to-do). Argo CD runs it with the object as `obj`
-- and only Lua 5.1's base, table, string and math libraries; docs/install-argocd.md#health-check
-- says what each state means. Every field is checked for its type, and the work runs under
-- pcall: a script error would show the resource as Unknown with Lua's error as its message.

local MAX_MESSAGE = 1000

local function text(v)
  if type(v) ~= "string" then
    return ""
  end
  if string.len(v) > MAX_MESSAGE then
    return string.sub(v, 1, MAX_MESSAGE) .. "..."
  end
  return v
end

local function number(v)
  if type(v) == "number" and v == v then -- not NaN
    return v
  end
  return nil
end

local function int(v)
  return string.format("%.0f", v)
end

local function conditions(status)
  local found = {}
  if type(status.conditions) ~= "table" then
    return found
  end
  for _, c in ipairs(status.conditions) do
    if type(c) == "table" and type(c.type) == "string" and found[c.type] == nil then
      found[c.type] = c
    end
  end
  return found
end

local function said(c)
  if c == nil then
    return ""
  end
  local reason, message = text(c.reason), text(c.message)
  if reason ~= "" and message ~= "" then
    return reason .. ": " .. message
  end
  return reason .. message
end

-- Roles of status.roles whose ready pods are fewer than desired, and whether every engine
-- role wants no pods (the router of a disaggregated service cannot be scaled to zero).
local function roles(status)
  local short, names, engine_pods, engine_roles = {}, {}, 0, 0
  if type(status.roles) ~= "table" then
    return short, false
  end
  for name, _ in pairs(status.roles) do
    if type(name) == "string" then
      table.insert(names, name)
    end
  end
  table.sort(names)
  for _, name in ipairs(names) do
    local role = status.roles[name]
    if type(role) == "table" then
      local desired, ready = number(role.desired), number(role.ready)
      if desired ~= nil and ready ~= nil and ready < desired then
        table.insert(short, name .. ": " .. int(ready) .. " of " .. int(desired) .. " pods ready")
      end
      if name ~= "router" or status.mode ~= "disaggregated" then
        engine_roles = engine_roles + 1
        engine_pods = engine_pods + (desired or 1)
      end
    end
  end
  return short, engine_roles > 0 and engine_pods == 0
end

local function assess(o)
  if type(o) ~= "table" then
    return "Unknown", "not an object"
  end
  local meta = o.metadata
  if type(meta) ~= "table" then
    meta = {}
  end
  local status = o.status
  if type(status) ~= "table" then
    return "Progressing", "waiting for the operator to write a status"
  end
  local generation = number(meta.generation)
  if meta.generation ~= nil and generation == nil then
    return "Unknown", "metadata.generation is not a number"
  end
  local observed = number(status.observedGeneration)
  if generation ~= nil and (observed == nil or observed < generation) then
    local seen = "none"
    if observed ~= nil then
      seen = int(observed)
    end
    return "Progressing", "the operator has not yet observed generation " .. int(generation)
      .. " (status describes " .. seen .. ")"
  end
  local found = conditions(status)
  local ready, progressing, degraded = found.Ready, found.Progressing, found.Degraded
  if degraded ~= nil and degraded.status == "True" then
    return "Degraded", said(degraded)
  end
  if ready == nil then
    return "Progressing", "waiting for the operator to report the Ready condition"
  end
  if ready.status ~= "True" then
    if ready.reason == "InvalidSpec" or ready.reason == "ChildConflict" then
      return "Degraded", said(ready)
    end
    if progressing ~= nil and progressing.status == "True" then
      return "Progressing", said(progressing)
    end
    if ready.status == "False" then
      return "Progressing", said(ready)
    end
    return "Unknown", "Ready is " .. text(ready.status) .. " " .. said(ready)
  end
  local short, zero = roles(status)
  if #short > 0 then
    return "Progressing", table.concat(short, "; ")
  end
  if progressing ~= nil and progressing.status == "True" then
    return "Progressing", said(progressing)
  end
  if zero then
    return "Suspended", "scaled to zero: every role has 0 replicas, nothing serves requests"
  end
  local message = text(ready.message)
  local scaling = found.ScalingActive
  if scaling ~= nil and scaling.status == "False" then
    message = message .. "; autoscaling paused: " .. said(scaling)
  end
  return "Healthy", message
end

local hs = {}
local ok, state, message = pcall(assess, obj)
if ok then
  hs.status = state
  hs.message = message
else
  hs.status = "Unknown"
  hs.message = "the health check failed: " .. tostring(state)
end
return hs
