-- The fence every producer write checks: the caller's generation is current and its lease live.
local function fenced(m_gen, m_exp, fence)
  if m_gen ~= fence then return 'ODB_FENCED ' .. fence .. ' ' .. m_gen end
  if tonumber(m_exp) <= now then return 'ODB_FENCED ' .. fence .. ' expired' end
  return nil
end
